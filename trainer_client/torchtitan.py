"""DataClient as a torchtitan data loader: `MsdDataLoader` subclasses torchtitan's own
`BaseDataLoader` (`torchtitan.components.dataloader`), so a torchtitan trainer takes it where it
takes its `ParallelAwareDataloader`.

It yields `(input_dict, labels)` as torchtitan's trainer expects: `input_dict["input"]` the
tokens, `positions` the position ids (they restart with each packed document), and the packing
metadata (`cu_seqlens`, `loss_mask`, `doc_keys`, `doc_offsets`, `piece_lengths`); `labels` with
-100 (torch's `ignore_index`) wherever `loss_mask` is 0, so torchtitan's cross-entropy leaves
padding and document ends out. The trainer forwards every key but `input` to the model as a
keyword argument: override its `post_dataloading_process` to build a document mask from
`cu_seqlens` and drop the keys the model does not take.

`MsdEvalDataLoader` is the validator's counterpart: torchtitan 0.3.0's `Validator` builds its
data loader from `Validator.Config.dataloader` at every validation (`config.build(dp_rank=...,
...)`); give it `MsdEvalDataLoader.Config(eval_set="heldout", client=client)` and each
validation is one pass over that eval set of the job (the same micro-batch count on every rank,
so `steps: -1`, one whole pass, does not hang as a dataset that runs out unevenly does).

State: keyed by data-parallel rank as `ParallelAwareDataloader` does (`dp_rank_{r}`, plus
`world_size`), so `torch.distributed.checkpoint` keeps one state per rank. Needs the optional
extra: `pip install megascale-data[torchtitan]`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torchtitan.components.dataloader import BaseDataLoader

from .client import DataClient

log = logging.getLogger("msd.torchtitan")

METADATA_KEYS = ("cu_seqlens", "loss_mask", "doc_keys", "doc_offsets", "piece_lengths")
IGNORE_INDEX = -100


class MsdDataLoader(BaseDataLoader):
    """torchtitan's training data loader, fed by a DataClient: yields `(input_dict, labels)` with
    `input`, `positions` and the packing metadata, labels -100 where `loss_mask` is 0. Its state
    is keyed `dp_rank_{r}`, as torchtitan's own loader keys it, so torchtitan's checkpointer saves
    and restores the client with the model."""

    def __init__(self, client: DataClient, dp_rank: int, dp_world_size: int) -> None:
        self.client = client
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self._rank_id = f"dp_rank_{dp_rank}"

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.client:
            input_dict = {"input": batch["tokens"], "positions": batch["position_ids"],
                          **{k: batch[k] for k in METADATA_KEYS}}
            labels = batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)
            yield input_dict, labels

    def state_dict(self) -> dict[str, Any]:
        return {self._rank_id: json.dumps(self.client.state_dict()), "world_size": self.dp_world_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:  # as ParallelAwareDataloader: an empty state is valid (a fresh start)
            return
        if self._rank_id not in state_dict:
            log.warning("data loader state is empty for dp rank %d, expected key %s", self.dp_rank, self._rank_id)
            return
        if state_dict["world_size"] != self.dp_world_size:
            raise ValueError(f"the checkpoint was written with {state_dict['world_size']} data-parallel ranks, this "
                             f"run has {self.dp_world_size}: start the client from its own state_dict instead")
        self.client.load_state_dict(json.loads(state_dict[self._rank_id]))


def _torchtitan_pair(batch: dict[str, Any]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    input_dict = {"input": batch["tokens"], "positions": batch["position_ids"], **{k: batch[k] for k in METADATA_KEYS}}
    return input_dict, batch["labels"].masked_fill(batch["loss_mask"] == 0, IGNORE_INDEX)


class MsdEvalDataLoader(BaseDataLoader):
    """One pass over an eval set of the job (`client.eval_batches`), as torchtitan's Validator
    takes its data loader: built from its Config at each validation."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseDataLoader.Config):
        eval_set: str = "heldout"
        """The job file's eval set."""
        client: Any = None
        """This rank's DataClient (a runtime object, as torchtitan's tokenizer is)."""
        infinite: bool = False
        """Set by the Validator; a pass is finite (msd serves every rank the same count)."""

    def __init__(self, config: "MsdEvalDataLoader.Config", **kwargs: Any) -> None:
        if config.client is None:
            raise ValueError("MsdEvalDataLoader.Config needs client= this rank's DataClient")
        self.config = config

    def __iter__(self) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
        for batch in self.config.client.eval_batches(self.config.eval_set):
            yield _torchtitan_pair(batch)

    def state_dict(self) -> dict[str, Any]:
        return {}  # a pass always starts at its beginning

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass
