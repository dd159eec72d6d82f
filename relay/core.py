"""A relay's decisions, without sockets or clocks: `RelayCore` takes its local ranks' messages, the
coordinator's, the workers' pieces and the time, and returns what to send where. The relay
process (`relay/process.py`) carries the actions out; the simulation (`msd.sim`) runs the same
core under simulated time.

What it decides: which local ranks a DP rank's pieces go to; when a step's `consumed` of the
host's ranks go up together (at most `hold_s` apart); what it says for its ranks (one heartbeat,
`relay_up`) and to them (their step headers from `relay_step`, the coordinator's `relay_down`);
what a coordinator's stop, refusal or failure means for them.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from msd_common.session import LOST_MESSAGES, Registration
from msd_common.topology import Topology

log = logging.getLogger("msd.relay")

HOLD_S = 0.05  # a step's `consumed` waits this long at most for the host's other ranks before it goes up
STOP_AFTER_S = 2.0  # after a failed job's job_failed, what the relay passes on to its ranks still goes out
RANK_LOST_BEATS = 3  # a local rank silent this many heartbeats is no longer reported alive


@dataclass(frozen=True, slots=True)
class ToCoordinator:
    message: P.Message


@dataclass(frozen=True, slots=True)
class ToRank:
    """Frames to a local rank's control socket (its identity at the relay's ROUTER)."""

    identity: bytes
    frames: list


@dataclass(frozen=True, slots=True)
class ToData:
    """A pieces message to a local rank's data socket (the frames as received: not copied)."""

    address: str
    frames: list


@dataclass(frozen=True, slots=True)
class ReleaseData:
    """The local rank at this data address is gone: drop what waits for it."""

    address: str


@dataclass(frozen=True, slots=True)
class MoveOn:
    """The coordinator stops: hello to the next address (a standby), or again to this one."""


Action = ToCoordinator | ToRank | ToData | ReleaseData | MoveOn


@dataclass
class LocalRank:
    rank: int
    identity: bytes  # its control socket at the relay's ROUTER
    data: str  # its data socket (ipc)
    last_seen: float
    dp: int = -1  # its data-parallel rank, once the topology is known


class RelayCore:
    def __init__(self, data_address: str, local: str, host: str, incarnation: int, hold_s: float = HOLD_S) -> None:
        """data_address: where workers push this host's pieces; local: where its ranks reach it."""
        self.data_address = data_address
        self.hold_s = hold_s
        self.relay_id: int | None = None
        self.topology: Topology | None = None
        self.ranks: dict[int, LocalRank] = {}
        self.rank_of: dict[bytes, int] = {}  # control identity -> rank
        self._by_dp: dict[int, list[str]] | None = None  # dp -> data addresses of its local ranks
        self.up_queue: list[P.Message] = []  # ranks' messages waiting for the next relay_up
        self.consumed: list[P.Consumed] = []  # and their plain `consumed` (its table)
        self.held: dict[int, dict[int, P.Consumed]] = {}  # step -> rank -> its `consumed`, until the host's are in
        self.held_since: dict[int, float] = {}
        self.bytes_in = self.bytes_out = 0  # pieces from workers, and to local ranks (fanned out)
        self.late_steps = 0  # steps whose `consumed` went up without every local rank's (one was late)
        self.dropped = 0  # pieces for a rank that is not here
        self.queued = 0  # pieces waiting in the shell's outbox (reported; the shell sets it)
        self.running = True
        self.refused: str | None = None  # why the coordinator refused our connection (CURVE keys)
        self.stop_at: float | None = None  # the job has ended: serve until then, then stop
        self.now = 0.0
        self.incarnation = incarnation
        self.registration = Registration(
            lambda: P.RelayHello(version=P.PROTOCOL_VERSION, host=host, data_address=data_address, local=local,
                                 incarnation=self.incarnation),
            self._heartbeat)

    def _heartbeat(self) -> P.RelayHeartbeat:
        return P.RelayHeartbeat(relay_id=self.relay_id if self.relay_id is not None else 0, **self._counters(self.now))

    def _counters(self, now: float) -> dict[str, Any]:
        """What the relay says of itself in every heartbeat and relay_up: the ranks it still hears."""
        alive = [r.rank for r in self.ranks.values()
                 if now - r.last_seen < RANK_LOST_BEATS * self.registration.heartbeat_s]
        return dict(ranks=alive, bytes_in=self.bytes_in, bytes_out=self.bytes_out, queued=self.queued,
                    late_steps=self.late_steps)

    def due(self, now: float) -> P.Message | None:
        """The hello or heartbeat due now, if one is."""
        self.now = now
        return self.registration.due(now)

    def turn(self, now: float) -> list[Action]:
        """Once per turn: steps whose `consumed` may go up, and the ranks' gathered messages."""
        self.now = now
        if self.stop_at is not None and now >= self.stop_at:
            self.running = False
        self._release_held(now)
        if not ((self.up_queue or self.consumed) and self.registration.registered):
            return []
        rows = np.array([(m.rank, m.step) for m in self.consumed], dtype=np.int64).reshape(-1, 2)
        waits = np.array([m.waited_s for m in self.consumed], dtype=np.float64)
        losses = [(m.rank, m.loss_step, s, n, x) for m in self.consumed if m.loss_step >= 0
                  for s, n, x in zip(m.loss_sources, m.loss_tokens, m.loss_sums)]
        out = [ToCoordinator(P.RelayUp(relay_id=self.relay_id, messages=[m.header() for m in self.up_queue],
                                       consumed=rows, waited_s=waits, **self._counters(now),
                                       losses=np.array([r[:4] for r in losses], np.int64).reshape(-1, 4),
                                       loss_sums=np.array([r[4] for r in losses], np.float64)))]
        self.registration.spoke(now)  # it says what a heartbeat says: one message a step per host
        self.up_queue, self.consumed = [], []
        return out

    def connection_lost(self, why: str) -> None:
        """Messages to or from the coordinator were lost (session.LOST_MESSAGES): the relay registers
        again; the coordinator forgets its ranks, and they say hello again through it (told at the
        welcome), each from the step it needs."""
        log.warning("relay: %s (%s); registering again", LOST_MESSAGES, why)
        self.incarnation += 1  # a new one: the coordinator forgets the old, and what its ranks were sent
        self.registration.forgotten()

    def refuse(self, reason: str) -> list[Action]:
        """The coordinator will never talk to this relay (a CURVE handshake it refused): its ranks
        are told why, and ranks that come later too."""
        self.refused = reason
        return self._to_all_ranks(P.Reject(reason=reason))

    # ------------------------------------------------------------------ the ranks' messages

    def on_local(self, identity: bytes, frames: list, now: float) -> list[Action]:
        try:
            msg = wire.receive(frames, P.TRAINER_UP)
        except ProtocolError as e:
            log.warning("relay: dropped a message from a local rank: %s", e)
            return []
        if isinstance(msg, P.TrainerHello):
            return self._on_hello(identity, msg, now)
        rank = self.rank_of.get(identity)
        if rank is None or rank != msg.rank:  # a rank speaks for itself only
            return [self._to_rank(identity, P.UnknownPeer(reason="this relay does not know this rank: say hello"))]
        self.ranks[rank].last_seen = now
        if isinstance(msg, P.TrainerHeartbeat):
            return [self._to_rank(identity, P.Alive())]
        if isinstance(msg, P.Consumed):
            self.held.setdefault(msg.step, {})[rank] = msg
            self.held_since.setdefault(msg.step, now)
            return []
        out: list[Action] = []
        if isinstance(msg, P.TrainerBye):
            out += self._forget_rank(rank)
        self.up_queue.append(msg)
        return out

    def _on_hello(self, identity: bytes, msg: P.TrainerHello, now: float) -> list[Action]:
        rank = msg.rank
        if self.refused is not None:  # a rank that comes after the refusal hears it too
            return [self._to_rank(identity, P.Reject(reason=self.refused))]
        out: list[Action] = []
        old = self.ranks.get(rank)
        if old is not None and old.identity != identity:  # the rank's process started again on this host
            log.info("relay: rank %d said hello again from a new process", rank)
            out += self._forget_rank(rank)
        if old is None or old.identity != identity or old.data != msg.data_address:
            self.ranks[rank] = LocalRank(rank, identity, msg.data_address, now, self._dp(rank))
            self.rank_of[identity] = rank
            self._by_dp = None
        self.ranks[rank].last_seen = now
        out.append(self._to_rank(identity, P.Alive()))  # the relay is here (the welcome comes later)
        # a rank says hello every 2 s until welcomed: while no coordinator answers, only its last one waits
        self.up_queue = [m for m in self.up_queue if not (isinstance(m, P.TrainerHello) and m.rank == rank)]
        self.up_queue.append(dataclasses.replace(msg, data_address=self.data_address))  # workers reach it through us
        return out

    def _forget_rank(self, rank: int) -> list[Action]:
        gone = self.ranks.pop(rank, None)
        if gone is None:
            return []
        self.rank_of.pop(gone.identity, None)
        self._by_dp = None
        for held in self.held.values():
            held.pop(rank, None)
        return [ReleaseData(gone.data)]

    def _release_held(self, now: float) -> None:
        """A step's `consumed` go up once every local rank's is in (or the wait is over: a late rank's
        goes up on its own when it comes)."""
        if not self.held:
            return
        live = {r.rank for r in self.ranks.values()
                if now - r.last_seen < RANK_LOST_BEATS * self.registration.heartbeat_s}
        for step in sorted(self.held):
            held = self.held[step]
            complete = live <= held.keys()
            if complete or now - self.held_since[step] > self.hold_s:
                if not complete:
                    self.late_steps += 1
                for r in sorted(held):  # with compute times (balance.calibrate): a message of its own
                    (self.consumed if held[r].compute_step < 0 else self.up_queue).append(held[r])
                del self.held[step], self.held_since[step]

    @staticmethod
    def _to_rank(identity: bytes, message: P.Message) -> ToRank:
        return ToRank(identity, wire.encode(message))

    def _to_all_ranks(self, message: P.Message) -> list[Action]:
        frames = wire.encode(message)
        return [ToRank(r.identity, frames) for r in self.ranks.values()]

    # ------------------------------------------------------------------ the coordinator's messages

    def on_up(self, frames: list, now: float) -> list[Action]:
        try:
            msg = wire.receive(frames, P.RELAY_INBOX)
        except ProtocolError as e:
            log.warning("relay: dropped a message from the coordinator: %s", e)
            return []
        if isinstance(msg, P.RelayDown):
            return self._fan_out_control(msg.parts, msg.blob)
        if isinstance(msg, P.RelayStep):
            return [ToRank(self.ranks[rank].identity, frames) for rank, frames in step_headers(msg)
                    if rank in self.ranks]
        if isinstance(msg, P.RelayWelcome):
            if self.registration.registered and msg.relay_id == self.relay_id:
                return []  # the answer to a hello sent again before the first answer came
            again = self.relay_id is not None
            self.registration.welcomed(float(msg.heartbeat_s))
            self.relay_id = msg.relay_id
            self.topology = Topology(**msg.topology)
            for r in self.ranks.values():
                r.dp = self._dp(r.rank)
            self._by_dp = None
            log.info("relay %d: welcomed by the coordinator", self.relay_id)
            if again:  # a coordinator that does not know our ranks: they say hello again, through us
                return self._to_all_ranks(P.UnknownPeer(reason="the relay registered again"))
            return []
        if isinstance(msg, P.UnknownPeer):
            log.warning("relay: the coordinator does not know this relay (%s); registering again", msg.reason)
            self.registration.forgotten()
            self.up_queue = [m for m in self.up_queue if isinstance(m, P.TrainerHello)]
            self.consumed = []
            self.held.clear()
            self.held_since.clear()
            return []
        if isinstance(msg, P.Reject):
            log.error("relay: the coordinator refused this relay: %s", msg.reason)
            self.running = False
            return self._to_all_ranks(P.Reject(reason=f"the relay was refused: {msg.reason}"))
        if isinstance(msg, P.Shutdown):  # its ranks are told through it (relay_down)
            # The coordinator stops, never the job: a standby (the next address) or a coordinator
            # restarted at this one takes over, and the relay carries on with it. (Until issue 58 a
            # relay with one address exited 2 s after a shutdown: a coordinator's graceful restart
            # left its ranks without a relay; found by msd.sim, seed 309.)
            log.warning("relay: the coordinator is stopping (%s); waiting for a coordinator to serve", msg.reason)
            return [MoveOn()]
        if isinstance(msg, P.JobFailed) and self.stop_at is None:  # a failed job's coordinator answers anything
            log.error("relay: the job failed: %s", msg.reason)
            self.stop_at = now + STOP_AFTER_S
            return self._to_all_ranks(P.JobFailed(reason=msg.reason))
        return []

    def _fan_out_control(self, parts: list, blob: Any) -> list[Action]:
        view = memoryview(blob).cast("B") if len(blob) else memoryview(b"")
        at = 0
        out: list[Action] = []
        for rank, header, sizes in parts:
            frames = [msgpack.packb(header, use_bin_type=True)]
            for n in sizes:
                frames.append(view[at:at + n])
                at += n
            if at > len(view):
                log.warning("relay: relay_down of %d bytes is shorter than its parts; the rest dropped", len(view))
                return out
            r = self.ranks.get(rank)
            if r is not None:
                out.append(ToRank(r.identity, frames))
        return out

    # ------------------------------------------------------------------ the workers' pieces

    def _dp(self, rank: int) -> int:
        return self.topology.coords(rank).dp if self.topology is not None else -1

    def on_data(self, frames: list, header_bytes: Any = None) -> list[Action]:
        """A pieces message from a worker: to every local rank of its DP rank (header_bytes: its
        first frame's buffer, where the shell has it without a copy)."""
        size = sum(len(f) for f in frames)
        self.bytes_in += size
        try:
            header = wire.unpack_header(frames[0] if header_bytes is None else header_bytes)
            rank = header["rank"]
            if header.get("type") != "pieces" or type(rank) is not int:
                raise ProtocolError("not a pieces message")
        except (ProtocolError, KeyError, TypeError) as e:
            log.warning("relay: dropped a data message: %s", e)
            return []
        targets = self._targets(rank)
        if not targets:
            self.dropped += 1
            return []
        self.bytes_out += size * len(targets)
        return [ToData(address, frames) for address in targets]  # the same frames to each: zmq shares them

    def _targets(self, rank: int) -> list[str]:
        """The data addresses of the local ranks that get `rank`'s pieces: those of its DP rank."""
        if self.topology is None:
            return []
        if self._by_dp is None:
            self._by_dp = {}
            for r in sorted(self.ranks.values(), key=lambda r: r.rank):
                self._by_dp.setdefault(r.dp, []).append(r.data)
        return self._by_dp.get(self._dp(rank), [])


def step_headers(msg: P.RelayStep) -> list[tuple[int, list]]:
    """The step_header of each rank a relay_step names, as the coordinator would send it directly:
    (rank, frames)."""
    counts = msg.counts.reshape(len(msg.dps), -1)
    ends = np.cumsum(msg.piece_counts).tolist()
    starts = [0, *ends[:-1]]
    out = []
    for rank, i in msg.ranks:
        header = P.step_header(msg.step, rank, msg.row_len, msg.max_over_mean, msg.naive_max_over_mean,
                               msg.rank_costs[i], msg.naive_costs[i], msg.pieces[starts[i]:ends[i]], counts[i])
        out.append((rank, wire.encode(header)))
    return out
