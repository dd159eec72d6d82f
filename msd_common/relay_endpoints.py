"""Where a trainer host's relay and its ranks meet: the ipc endpoints both sides compute (the relay
binds them, `DataClient(relay="auto")` and MSD_RELAY=auto find them)."""

from __future__ import annotations

import hashlib
import os
import tempfile


def default_endpoint(coordinator: str) -> str:
    """The ipc endpoint of a job's relay on this host, from the coordinator's address: what `msd
    relay` binds and `DataClient(relay="auto")` (or MSD_RELAY=auto) connects to by default."""
    tag = hashlib.sha1(coordinator.encode()).hexdigest()[:12]
    return f"ipc://{tempfile.gettempdir()}/msd-relay-{tag}.sock"


def rank_endpoint(relay: str, rank: int) -> str:
    """The ipc endpoint a rank behind `relay` binds its data socket on (beside the relay's)."""
    where = os.path.dirname(relay[len("ipc://"):]) if relay.startswith("ipc://") else tempfile.gettempdir()
    return f"ipc://{where or '.'}/msd-rank-{rank}-{os.getpid()}-{os.urandom(3).hex()}.sock"
