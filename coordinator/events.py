"""The coordinator's input: typed events, one per decoded message, plus the clock and the stop.

The shell (app.py) turns every message that passed `wire.decode` into one of these, stamped with
the monotonic time it was received (`at`), and hands them to `CoordinatorState.handle`. Time
enters the state only this way: through `at` and through `Tick`. Fields mirror the messages of
`msd_common.protocol` one to one (arrays by their frame names), so `from_message` needs no
per-type code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    at: float  # monotonic seconds, from the shell's clock


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerEvent(Event):
    peer: bytes  # the sender's socket identity: where answers go
    # a rank's message that came through its host's relay: the relay's socket identity (`peer` is
    # then the rank's identity at this coordinator, relay.relayed_identity); b"" for a direct one
    via: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class Tick(Event):
    """Time passes: heartbeat deadlines, scaling decisions and the status are checked."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Shutdown(Event):
    """The coordinator stops (a signal, or the end of the job): peers are told. `failed`: the fatal
    error that stopped the job, if one did (ranks raise it)."""

    reason: str
    failed: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerGone(PeerEvent):
    """A send to this peer found its connection gone (EHOSTUNREACH: the process died or its socket
    closed; a peer that reconnects comes back with another identity): no need to wait for three
    heartbeats of silence. dropped: the connection is there, but a message to it was dropped (its
    queue full): the peer would wait for it for good, so it registers again."""

    dropped: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerHello(PeerEvent):
    version: int
    host: str
    pid: int
    incarnation: int
    agent: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerHeartbeat(PeerEvent):
    worker_id: int
    cached_records: int
    busy_s: float
    backlog: int = 0  # piece messages waiting for a rank's socket
    send_waits: int = 0  # sends that found a rank's socket full, since registration


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared(PeerEvent):
    worker_id: int
    task_id: int
    skipped: list  # [[index in the task, reason, kind]]
    busy_s: float
    lengths: np.ndarray
    patches: np.ndarray
    # per record, its images' patches squared, summed (the encoder's attention is per image);
    # absent in stimulus logs written before it existed
    patch_squares: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass(frozen=True, slots=True, kw_only=True)
class TaskFailed(PeerEvent):
    worker_id: int
    task_id: int
    reason: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivered(PeerEvent):
    worker_id: int
    delivery_id: int
    failed: list = field(default_factory=list)  # [[source, record, reason, kind]]: sent with nothing to train on
    unserved: int = 0  # pieces it could not send (its cache lacks them)


@dataclass(frozen=True, slots=True, kw_only=True)
class HostHello(PeerEvent):
    version: int
    agent_id: int
    host: str
    procs: int
    min_procs: int
    max_procs: int
    auto: int


@dataclass(frozen=True, slots=True, kw_only=True)
class HostHeartbeat(PeerEvent):
    agent_id: int
    procs: int
    pids: Any = ()  # its worker processes that are alive: it vouches for them


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayHello(PeerEvent):
    version: int
    host: str
    data_address: str
    local: str
    incarnation: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayHeartbeat(PeerEvent):
    relay_id: int
    ranks: Any  # the ranks behind it that are alive
    bytes_in: int = 0
    bytes_out: int = 0
    queued: int = 0
    late_steps: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayReport(RelayHeartbeat):
    """What a relay_up says of the relay (as a heartbeat does, unanswered), and the `consumed` of
    its ranks, gathered (its table)."""

    consumed: np.ndarray  # protocol.RELAY_CONSUMED rows: rank, step
    waited_s: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerHello(PeerEvent):
    version: int
    rank: int
    data_address: str
    resume_step: int
    incarnation: int
    metadata_only: int
    # The coordinator's state before resume_step from the trainer's checkpoint (None: not carried).
    carried: Any = None
    # The planner state before resume_step, read by the shell from the journal file when the
    # step is older than the states the coordinator keeps in memory (None otherwise).
    journaled_state: dict | None = field(default=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerExited(PeerEvent):
    """A host agent saw one of its worker processes end, and what task it was working on."""

    agent_id: int
    pid: int
    exitcode: int
    task_id: int  # -1: none
    source: int = -1  # the sample it was making (-1: none)
    record: int = -1
    overran_s: float = 0.0  # > 0: stopped by its agent, the sample that far past max_sample_s


@dataclass(frozen=True, slots=True, kw_only=True)
class Consumed(PeerEvent):
    rank: int
    step: int
    waited_s: float
    compute_step: int = -1  # the step whose micro-batches compute_s times (balance.calibrate)
    compute_s: Any = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerHeartbeat(PeerEvent):
    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerBye(PeerEvent):
    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class StateRequest(PeerEvent):
    rank: int
    step: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MixRequest(PeerEvent):
    at_step: int
    weights: Any


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalRequest(PeerEvent):
    rank: int
    set: str
    pass_no: int


@dataclass(frozen=True, slots=True, kw_only=True)
class EvalReport(PeerEvent):
    rank: int
    set: str
    step: int
    losses: Any


MESSAGE_EVENTS: dict[str, type[PeerEvent]] = {
    "worker_hello": WorkerHello, "worker_heartbeat": WorkerHeartbeat, "prepared": Prepared,
    "task_failed": TaskFailed, "delivered": Delivered, "host_hello": HostHello, "host_heartbeat": HostHeartbeat,
    "worker_exited": WorkerExited, "trainer_hello": TrainerHello, "consumed": Consumed,
    "trainer_heartbeat": TrainerHeartbeat, "trainer_bye": TrainerBye, "mix_request": MixRequest,
    "state_request": StateRequest, "eval_request": EvalRequest, "eval_report": EvalReport,
    "relay_hello": RelayHello, "relay_heartbeat": RelayHeartbeat,
}
ALL_EVENTS: dict[str, type[Event]] = {cls.__name__: cls for cls in (Tick, Shutdown, RelayReport, PeerGone,
                                                                     *MESSAGE_EVENTS.values())}


_FIELDS = {cls: frozenset(f.name for f in fields(cls)) - {"peer", "at", "via"} for cls in MESSAGE_EVENTS.values()}


def from_message(peer: bytes, at: float, header: dict[str, Any], arrays: dict[str, np.ndarray],
                 via: bytes = b"") -> PeerEvent:
    """The event of one decoded message (its type is one of COORDINATOR_INBOX, and every field
    its schema names is there and valid: wire.decode checked). Fields the schema does not name
    (a newer peer's additions) are left out."""
    cls = MESSAGE_EVENTS[header["type"]]
    names = _FIELDS[cls]
    return cls(peer=peer, at=at, via=via, **{k: v for k, v in header.items() if k in names}, **arrays)


def to_dict(event: Event) -> dict[str, Any]:
    """A plain form of an event (for the stimulus log): its class name and its fields."""
    return {"event": type(event).__name__, **{f.name: getattr(event, f.name) for f in fields(event)}}


def from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    return ALL_EVENTS[d.pop("event")](**d)
