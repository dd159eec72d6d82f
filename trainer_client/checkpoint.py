"""The client's state inside `torch.distributed.checkpoint` (DCP).

DCP keeps one copy of every key that all ranks save (it deduplicates replicated entries), so a
state that differs per rank must live under a key of its own: `DataClientState(client)` is the
client's state under `rank_{global rank}`, as torchtitan keys its loaders' states by
`dp_rank_{r}`. Use it as any Stateful:

    dcp.save({"model": ..., "data": DataClientState(client)}, checkpoint_id=path)
    dcp.load({"model": ..., "data": DataClientState(client)}, checkpoint_id=path)  # before iterating
"""

from __future__ import annotations

import json
from typing import Any

from .client import DataClient


class DataClientState:
    """A torch.distributed.checkpoint Stateful holding one DataClient's state under its rank."""

    def __init__(self, client: DataClient) -> None:
        self.client = client
        self.key = f"rank_{client.rank}"

    def state_dict(self) -> dict[str, Any]:
        # One JSON string, not a nested dict: DCP flattens dicts into keys, and a load must name
        # the same keys as the save (the carried coordinator state's keys vary with the job).
        return {self.key: json.dumps(self.client.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.key not in state:
            raise KeyError(f"the checkpoint holds no DataClient state for {self.key} (it has {sorted(state)})")
        self.client.load_state_dict(json.loads(state[self.key]))
