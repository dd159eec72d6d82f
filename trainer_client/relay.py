"""The relay: one per trainer host (the paper's Data Constructor), `msd relay`.

Without a relay, every worker process holds a connection to every rank it delivers to (W x R)
and every rank speaks to the coordinator on its own. With one, a host's ranks connect to their
relay over ipc (`DataClient(..., relay=ENDPOINT)`), and the relay:

- takes the host's pieces from the workers on one data socket (one connection per worker
  process) and fans each out to the local ranks of its data-parallel rank: the coordinator asks
  for a DP rank's pieces once per relay, so a piece that several local ranks need (TP ranks, CP
  shards, a middle pipeline stage's metadata) crosses the network once;
- speaks for its ranks to the coordinator on one connection: one heartbeat for all of them (it
  answers theirs itself), their messages gathered into `relay_up` (a step's `consumed` of every
  local rank in one), and the coordinator's messages to them in one `relay_down` per burst.

It decides nothing and holds nothing its ranks and the coordinator cannot rebuild: killed and
started again, its ranks say hello through the new one with the step they need, and the
coordinator plans again from there (the stream is unchanged; pieces a rank has are dropped as
duplicates). Every message to a rank is checked by the rank; the relay reads only what it routes
by (a message's rank).
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import socket
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import zmq

from msd_common import protocol as P
from msd_common import security, wire
from msd_common.errors import ProtocolError
from msd_common.outbox import RankOutbox
from msd_common.session import PeerLoop, Registration
from msd_common.sockets import make_socket, send_frames_nowait, send_nowait, waiting
from msd_common.topology import Topology

log = logging.getLogger("msd.relay")

HOLD_S = 0.05  # a step's `consumed` waits this long at most for the host's other ranks before it goes up
STOP_AFTER_S = 2.0  # after the coordinator's shutdown, what it sent its ranks still goes out
RANK_LOST_BEATS = 3  # a local rank silent this many heartbeats is no longer reported alive


def default_endpoint(coordinator: str) -> str:
    """The ipc endpoint of a job's relay on this host, from the coordinator's address: what `msd
    relay` binds and `DataClient(relay="auto")` (or MSD_RELAY=auto) connects to by default."""
    tag = hashlib.sha1(coordinator.encode()).hexdigest()[:12]
    return f"ipc://{tempfile.gettempdir()}/msd-relay-{tag}.sock"


def rank_endpoint(relay: str, rank: int) -> str:
    """The ipc endpoint a rank behind `relay` binds its data socket on (beside the relay's)."""
    where = os.path.dirname(relay[len("ipc://"):]) if relay.startswith("ipc://") else tempfile.gettempdir()
    return f"ipc://{where or '.'}/msd-rank-{rank}-{os.getpid()}-{os.urandom(3).hex()}.sock"


@dataclass
class LocalRank:
    rank: int
    identity: bytes  # its control socket at the relay's ROUTER
    data: str  # its data socket (ipc)
    last_seen: float
    dp: int = -1  # its data-parallel rank, once the topology is known


class Relay:
    """One relay process's state and sockets; `run()` serves until stopped."""

    def __init__(self, coordinator: str, *, host: str = "127.0.0.1", local: str | None = None,
                 bind_host: str | None = None, port: int = 0, keys_dir: str | None = None,
                 hold_s: float = HOLD_S) -> None:
        self.coordinator = coordinator
        self.host = host
        self.local = local or default_endpoint(coordinator)
        self.bind_host = bind_host or host
        self.port = port
        self.keys_dir = keys_dir
        self.hold_s = hold_s
        self.relay_id: int | None = None
        self.topology: Topology | None = None
        self.ranks: dict[int, LocalRank] = {}
        self.rank_of: dict[bytes, int] = {}  # control identity -> rank
        self._by_dp: dict[int, list[str]] | None = None  # dp -> data addresses of its local ranks
        self.up_queue: list[dict[str, Any]] = []  # ranks' messages waiting for the next relay_up
        self.consumed: list[dict[str, Any]] = []  # and their plain `consumed` (its table)
        self.held: dict[int, dict[int, dict]] = {}  # step -> rank -> its `consumed`, until the host's are in
        self.held_since: dict[int, float] = {}
        self.bytes_in = self.bytes_out = 0  # pieces from workers, and to local ranks (fanned out)
        self.late_steps = 0  # steps whose `consumed` went up without every local rank's (one was late)
        self.dropped = 0  # pieces for a rank that is not here
        self.running = True
        self.refused: str | None = None  # why the coordinator refused our connection (CURVE keys)
        self.stop_at: float | None = None  # the job has ended: serve until then, then stop
        self.data_address: str | None = None

    # ------------------------------------------------------------------ the loop

    def run(self, ready=None) -> None:
        ctx = zmq.Context()
        auth = security.start_authenticator(ctx, self.keys_dir) if self.keys_dir else None
        up = make_socket(ctx, zmq.DEALER)
        local = make_socket(ctx, zmq.ROUTER)
        local.setsockopt(zmq.ROUTER_MANDATORY, 1)
        data_in = make_socket(ctx, zmq.PULL, hwm=10_000)
        if self.keys_dir:
            keys = security.load(self.keys_dir, "trainer")  # a relay speaks for trainer ranks: their key
            security.as_client(up, keys, security.public_key(self.keys_dir, "coordinator"))
            security.as_server(data_in, keys)
        if self.local.startswith("ipc://"):
            path = self.local[len("ipc://"):]
            if os.path.exists(path):  # a relay killed before it could remove it; ours now
                os.unlink(path)
        local.bind(self.local)
        if self.port:
            data_in.bind(f"tcp://{self.bind_host}:{self.port}")
            port = self.port
        else:
            port = data_in.bind_to_random_port(f"tcp://{self.bind_host}")
        self.data_address = f"tcp://{self.host}:{port}"
        self.up, self.local_sock = up, local
        incarnation = int.from_bytes(os.urandom(6), "little")
        self.registration = Registration(
            lambda: P.make(P.RELAY_HELLO, version=P.PROTOCOL_VERSION, host=socket.gethostname(),
                           data_address=self.data_address, local=self.local, incarnation=incarnation),
            self._heartbeat)
        self.loop = loop = PeerLoop(up, self.registration, self.coordinator, who="relay")
        self.outbox = RankOutbox(lambda address: self._push(ctx, address), self._writable)
        loop.on(up, self._on_up)
        loop.on(local, self._on_local)
        loop.on(data_in, self._on_data)
        handshakes = security.HandshakeWatch(up)
        loop.on(handshakes.socket, lambda _: self._on_handshake(handshakes))
        log.info("relay: ranks at %s, workers at %s, coordinator %s", self.local, self.data_address,
                 self.coordinator)
        if ready is not None:
            ready(self)
        try:
            loop.run(lambda: self.running, self._turn)
        finally:
            handshakes.close()
            self.outbox.close()
            for s in (up, local, data_in):
                s.close(linger=500)
            if auth is not None:
                auth.stop()
            ctx.term()

    def stop(self, *_: Any) -> None:
        self.running = False

    def _on_handshake(self, handshakes: security.HandshakeWatch) -> None:
        reason = handshakes.refused()
        if reason is not None:  # the coordinator will never talk to this relay: its ranks are told why
            why = (f"the coordinator at {self.loop.address} refused the relay's connection ({reason}); the job sets "
                   f"security.curve? {'check' if self.keys_dir else 'give the relay'} --keys, the job's key directory")
            log.error("relay: %s", why)
            self._to_all_ranks(P.make(P.REJECT, reason=why))
            self.refused = why

    def _push(self, ctx: zmq.Context, address: str) -> zmq.Socket:
        sock = make_socket(ctx, zmq.PUSH, hwm=10_000)
        sock.connect(address)
        return sock

    def _writable(self, sock: zmq.Socket, on: bool) -> None:
        self.loop.on_writable(sock, self.outbox.flush if on else None)

    def _heartbeat(self) -> dict[str, Any]:
        return P.make(P.RELAY_HEARTBEAT, relay_id=self.relay_id if self.relay_id is not None else 0,
                      **self._counters())

    def _counters(self) -> dict[str, Any]:
        """What the relay says of itself in every heartbeat and relay_up: the ranks it still hears."""
        now = time.monotonic()
        alive = [r.rank for r in self.ranks.values()
                 if now - r.last_seen < RANK_LOST_BEATS * self.registration.heartbeat_s]
        return dict(ranks=alive, bytes_in=self.bytes_in, bytes_out=self.bytes_out, queued=self.outbox.backlog(),
                    late_steps=self.late_steps)

    def _turn(self, now: float) -> None:
        if self.stop_at is not None and now >= self.stop_at:
            self.running = False
        self._release_held(now)
        if (self.up_queue or self.consumed) and self.registration.registered:
            rows = np.array([(m["rank"], m["step"]) for m in self.consumed], dtype=np.int64).reshape(-1, 2)
            waits = np.array([m["waited_s"] for m in self.consumed], dtype=np.float64)
            if send_nowait(self.up, P.make(P.RELAY_UP, relay_id=self.relay_id, messages=self.up_queue,
                                           **self._counters()), rows, waits):
                self.registration.spoke(now)  # it says what a heartbeat says: one message a step per host
            else:
                log.warning("relay: coordinator not reading; %d messages of the ranks dropped",
                            len(self.up_queue) + len(self.consumed))
            self.up_queue, self.consumed = [], []

    # ------------------------------------------------------------------ the ranks' messages

    def _on_local(self, sock: zmq.Socket) -> None:
        for frames in waiting(sock, copy=True):
            identity, now = frames[0], time.monotonic()
            try:
                msg, _ = wire.decode(frames[1:], P.TRAINER_UP)
            except ProtocolError as e:
                log.warning("relay: dropped a message from a local rank: %s", e)
                continue
            kind = msg["type"]
            if kind == "trainer_hello":
                self._on_hello(identity, msg, now)
                continue
            rank = self.rank_of.get(identity)
            if rank is None or rank != msg["rank"]:  # a rank speaks for itself only
                self._to_rank(identity, P.make(P.UNKNOWN_PEER, reason="this relay does not know this rank: say hello"))
                continue
            self.ranks[rank].last_seen = now
            if kind == "trainer_heartbeat":
                self._to_rank(identity, P.make(P.ALIVE))
            elif kind == "consumed":
                self.held.setdefault(msg["step"], {})[rank] = msg
                self.held_since.setdefault(msg["step"], now)
            else:
                if kind == "trainer_bye":
                    self._forget_rank(rank)
                self.up_queue.append(msg)

    def _on_hello(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        rank = msg["rank"]
        if self.refused is not None:  # a rank that comes after the refusal hears it too
            self._to_rank(identity, P.make(P.REJECT, reason=self.refused))
            return
        old = self.ranks.get(rank)
        if old is not None and old.identity != identity:  # the rank's process started again on this host
            log.info("relay: rank %d said hello again from a new process", rank)
            self._forget_rank(rank)
        if old is None or old.identity != identity or old.data != msg["data_address"]:
            self.ranks[rank] = LocalRank(rank, identity, msg["data_address"], now, self._dp(rank))
            self.rank_of[identity] = rank
            self._by_dp = None
        self.ranks[rank].last_seen = now
        self._to_rank(identity, P.make(P.ALIVE))  # the relay is here (the coordinator's welcome comes later)
        # a rank says hello every 2 s until welcomed: while no coordinator answers, only its last one waits
        self.up_queue = [m for m in self.up_queue if not (m["type"] == "trainer_hello" and m["rank"] == rank)]
        self.up_queue.append({**msg, "data_address": self.data_address})  # workers reach it through us

    def _forget_rank(self, rank: int) -> None:
        gone = self.ranks.pop(rank, None)
        if gone is None:
            return
        self.rank_of.pop(gone.identity, None)
        self.outbox.release(gone.data)
        self._by_dp = None
        for held in self.held.values():
            held.pop(rank, None)

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
                    (self.consumed if held[r]["compute_step"] < 0 else self.up_queue).append(held[r])
                del self.held[step], self.held_since[step]

    def _to_rank(self, identity: bytes, header: dict[str, Any]) -> None:
        try:
            send_frames_nowait(self.local_sock, [identity, *wire.encode(header)])
        except zmq.ZMQError:  # gone, or not reading: it says hello again when it is back
            pass

    def _to_all_ranks(self, header: dict[str, Any]) -> None:
        for r in list(self.ranks.values()):
            self._to_rank(r.identity, header)

    # ------------------------------------------------------------------ the coordinator's messages

    def _on_up(self, sock: zmq.Socket) -> None:
        frames = sock.recv_multipart(copy=False)
        try:
            msg, arrays = wire.decode(frames, P.RELAY_INBOX)
        except ProtocolError as e:
            log.warning("relay: dropped a message from the coordinator: %s", e)
            return
        kind = msg["type"]
        if kind == "relay_down":
            self._fan_out_control(msg["parts"], arrays["blob"])
        elif kind == "relay_step":
            for rank, frames in step_headers(msg, arrays):
                r = self.ranks.get(rank)
                if r is not None:
                    try:
                        send_frames_nowait(self.local_sock, [r.identity, *frames], copy=False)
                    except zmq.ZMQError:
                        pass
        elif kind == "relay_welcome":
            again = self.relay_id is not None
            self.registration.welcomed(float(msg["heartbeat_s"]))
            self.relay_id = msg["relay_id"]
            self.topology = Topology(**msg["topology"])
            for r in self.ranks.values():
                r.dp = self._dp(r.rank)
            self._by_dp = None
            log.info("relay %d: welcomed by the coordinator at %s", self.relay_id, self.loop.address)
            if again:  # a coordinator that does not know our ranks: they say hello again, through us
                self._to_all_ranks(P.make(P.UNKNOWN_PEER, reason="the relay registered again"))
        elif kind == "unknown_peer":
            log.warning("relay: the coordinator does not know this relay (%s); registering again", msg["reason"])
            self.registration.forgotten()
            self.up_queue = [m for m in self.up_queue if m["type"] == "trainer_hello"]
            self.consumed = []
            self.held.clear()
            self.held_since.clear()
        elif kind == "reject":
            log.error("relay: the coordinator refused this relay: %s", msg["reason"])
            self._to_all_ranks(P.make(P.REJECT, reason=f"the relay was refused: {msg['reason']}"))
            self.running = False
        elif kind == "shutdown":  # its ranks are told through it (relay_down)
            if len(self.loop.addresses) > 1:  # a standby takes over: the relay carries on with it
                log.warning("relay: the coordinator is stopping (%s); moving on to the next address", msg["reason"])
                self.loop.coordinator_stopping(time.monotonic())
            else:  # what it sent its ranks still goes out for a moment
                log.info("relay: the coordinator stops (%s)", msg["reason"])
                self.stop_at = time.monotonic() + STOP_AFTER_S
        elif kind == "job_failed":  # a failed job's coordinator answers whatever the relay says: its ranks raise
            if self.stop_at is None:
                log.error("relay: the job failed: %s", msg["reason"])
                self._to_all_ranks(P.make(P.JOB_FAILED, reason=msg["reason"]))
                self.stop_at = time.monotonic() + STOP_AFTER_S

    def _fan_out_control(self, parts: list, blob: Any) -> None:
        view = memoryview(blob).cast("B") if len(blob) else memoryview(b"")
        at = 0
        for rank, header, sizes in parts:
            frames = [msgpack.packb(header, use_bin_type=True)]
            for n in sizes:
                frames.append(view[at:at + n])
                at += n
            if at > len(view):
                log.warning("relay: relay_down of %d bytes is shorter than its parts; the rest dropped", len(view))
                return
            r = self.ranks.get(rank)
            if r is None:
                continue
            try:
                send_frames_nowait(self.local_sock, [r.identity, *frames], copy=False)
            except zmq.ZMQError:
                pass

    # ------------------------------------------------------------------ the workers' pieces

    def _dp(self, rank: int) -> int:
        return self.topology.coords(rank).dp if self.topology is not None else -1

    def _on_data(self, sock: zmq.Socket) -> None:
        for frames in waiting(sock):
            size = sum(len(f) for f in frames)
            self.bytes_in += size
            try:
                header = wire.unpack_header(frames[0].buffer)
                rank = header["rank"]
                if header.get("type") != "pieces" or type(rank) is not int:
                    raise ProtocolError("not a pieces message")
            except (ProtocolError, KeyError, TypeError) as e:
                log.warning("relay: dropped a data message: %s", e)
                continue
            targets = self._targets(rank)
            if not targets:
                self.dropped += 1
                continue
            for address in targets:  # the same frames to each: zmq shares their buffers
                self.outbox.send(address, frames, False)
                self.bytes_out += size

    def _targets(self, rank: int) -> list[str]:
        """The data addresses of the local ranks that get `rank`'s pieces: those of its DP rank."""
        if self.topology is None:
            return []
        if self._by_dp is None:
            self._by_dp = {}
            for r in sorted(self.ranks.values(), key=lambda r: r.rank):
                self._by_dp.setdefault(r.dp, []).append(r.data)
        return self._by_dp.get(self._dp(rank), [])


def step_headers(msg: dict[str, Any], arrays: dict[str, np.ndarray]) -> list[tuple[int, list]]:
    """The step_header of each rank a relay_step names, as the coordinator would send it directly:
    (rank, frames)."""
    counts = arrays["counts"].reshape(len(msg["dps"]), -1)
    ends = np.cumsum(msg["piece_counts"]).tolist()
    starts = [0, *ends[:-1]]
    costs, naive = msg["rank_costs"], msg["naive_costs"]
    out = []
    for rank, i in msg["ranks"]:
        plan = {"max_over_mean": msg["max_over_mean"], "naive_max_over_mean": msg["naive_max_over_mean"],
                "rank_cost": costs[i], "naive_rank_cost": naive[i]}
        header = P.make(P.STEP_HEADER, step=msg["step"], rank=rank, row_len=msg["row_len"], plan=plan)
        out.append((rank, wire.encode(header, arrays["pieces"][starts[i]:ends[i]], counts[i])))
    return out


def serve(coordinator: str, **kwargs: Any) -> None:
    """Run a relay until SIGTERM or SIGINT (`msd relay`)."""
    relay = Relay(coordinator, **kwargs)
    signal.signal(signal.SIGTERM, relay.stop)
    signal.signal(signal.SIGINT, relay.stop)
    relay.run()
