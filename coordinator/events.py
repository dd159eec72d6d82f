"""The coordinator's input: typed events, one per decoded message, plus the clock and the stop.

The shell (app.py) turns every message that passed `wire.decode` into one of these, stamped with
the monotonic time it was received (`at`), and hands them to `CoordinatorState.handle`. Time
enters the state only this way: through `at` and through `Tick`. The event of a message is its
class in `msd_common.protocol` (the one declaration of its fields, arrays by their frame names)
with the sender and the time added, so `from_message` needs no per-type code.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from msd_common import protocol as P


@dataclass(frozen=True, kw_only=True)
class Event:
    at: float  # monotonic seconds, from the shell's clock


@dataclass(frozen=True, kw_only=True)
class PeerEvent(Event):
    peer: bytes  # the sender's socket identity: where answers go
    # a rank's message that came through its host's relay: the relay's socket identity (`peer` is
    # then the rank's identity at this coordinator, relay.relayed_identity); b"" for a direct one
    via: bytes = b""


@dataclass(frozen=True, kw_only=True)
class Tick(Event):
    """Time passes: heartbeat deadlines, scaling decisions and the status are checked."""


@dataclass(frozen=True, kw_only=True)
class Shutdown(Event):
    """The coordinator stops (a signal, or the end of the job): peers are told. `failed`: the fatal
    error that stopped the job, if one did (ranks raise it)."""

    reason: str
    failed: str = ""


@dataclass(frozen=True, kw_only=True)
class PeerGone(PeerEvent):
    """A send to this peer found its connection gone (EHOSTUNREACH: the process died or its socket
    closed; a peer that reconnects comes back with another identity): no need to wait for three
    heartbeats of silence. dropped: the connection is there, but a message to it was dropped (its
    queue full): the peer would wait for it for good, so it registers again."""

    dropped: bool = False


# The events of messages: each its protocol class (the one declaration of its fields), received.


@dataclass(frozen=True, kw_only=True)
class WorkerHello(PeerEvent, P.WorkerHello):
    pass


@dataclass(frozen=True, kw_only=True)
class WorkerHeartbeat(PeerEvent, P.WorkerHeartbeat):
    pass


@dataclass(frozen=True, kw_only=True)
class Prepared(PeerEvent, P.Prepared):
    pass


@dataclass(frozen=True, kw_only=True)
class TaskFailed(PeerEvent, P.TaskFailed):
    pass


@dataclass(frozen=True, kw_only=True)
class Delivered(PeerEvent, P.Delivered):
    pass


@dataclass(frozen=True, kw_only=True)
class HostHello(PeerEvent, P.HostHello):
    pass


@dataclass(frozen=True, kw_only=True)
class HostHeartbeat(PeerEvent, P.HostHeartbeat):
    pass


@dataclass(frozen=True, kw_only=True)
class WorkerExited(PeerEvent, P.WorkerExited):
    """A host agent saw one of its worker processes end, and what task it was working on."""


@dataclass(frozen=True, kw_only=True)
class RelayHello(PeerEvent, P.RelayHello):
    pass


@dataclass(frozen=True, kw_only=True)
class RelayHeartbeat(PeerEvent, P.RelayHeartbeat):
    pass


@dataclass(frozen=True, kw_only=True)
class RelayReport(PeerEvent, P.RelayUp):
    """What a relay_up says of the relay (as a heartbeat does, unanswered), and the `consumed` of
    its ranks, gathered (its table); its `messages` are events of their own (relaying.py)."""

    messages: list = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class TrainerHello(PeerEvent, P.TrainerHello):
    # The planner state before resume_step, read by the shell from the journal file when the
    # step is older than the states the coordinator keeps in memory (None otherwise).
    journaled_state: dict | None = None


@dataclass(frozen=True, kw_only=True)
class Consumed(PeerEvent, P.Consumed):
    pass


@dataclass(frozen=True, kw_only=True)
class TrainerHeartbeat(PeerEvent, P.TrainerHeartbeat):
    pass


@dataclass(frozen=True, kw_only=True)
class TrainerBye(PeerEvent, P.TrainerBye):
    pass


@dataclass(frozen=True, kw_only=True)
class StateRequest(PeerEvent, P.StateRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class MixRequest(PeerEvent, P.MixRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class EvalRequest(PeerEvent, P.EvalRequest):
    pass


@dataclass(frozen=True, kw_only=True)
class EvalReport(PeerEvent, P.EvalReport):
    pass


MESSAGE_EVENTS: dict[str, type[PeerEvent]] = {cls.TYPE: cls for cls in (
    WorkerHello, WorkerHeartbeat, Prepared, TaskFailed, Delivered, HostHello, HostHeartbeat, WorkerExited,
    TrainerHello, Consumed, TrainerHeartbeat, TrainerBye, MixRequest, StateRequest, EvalRequest, EvalReport,
    RelayHello, RelayHeartbeat)}
ALL_EVENTS: dict[str, type[Event]] = {cls.__name__: cls for cls in (Tick, Shutdown, RelayReport, PeerGone,
                                                                     *MESSAGE_EVENTS.values())}


def from_message(peer: bytes, at: float, header: dict[str, Any], arrays: dict[str, np.ndarray],
                 via: bytes = b"") -> PeerEvent:
    """The event of one decoded message (its type is one of COORDINATOR_INBOX, and every field
    its schema names is there and valid: wire.decode checked). Fields the schema does not name
    (a newer peer's additions) are left out."""
    cls = MESSAGE_EVENTS[header["type"]]
    return cls(peer=peer, at=at, via=via, **{name: header[name] for name in cls.KIND.fields}, **arrays)


def to_dict(event: Event) -> dict[str, Any]:
    """A plain form of an event (for the stimulus log): its class name and its fields."""
    return {"event": type(event).__name__, **{f.name: getattr(event, f.name) for f in fields(event)}}


def from_dict(d: dict[str, Any]) -> Event:
    d = dict(d)
    return ALL_EVENTS[d.pop("event")](**d)
