"""Many light trainer ranks in one process, for tools/bench_scale.py: each speaks the real protocol
(hello, heartbeats, consumed, its own data socket) and runs the real `ReceivingState` (decoding,
recipe checks, deduplication, each step's tokens copied into place), but hands nothing to a
trainer and builds no micro-batches (a DataClient builds each in the trainer's thread when it is
taken), so that 1,024 ranks fit on one small machine. One poller serves every rank.
With --step-s, a rank consumes step k no earlier than --step-s x k seconds after its process
consumed its first step, as ranks of a synchronous job finish their steps together.

With --per-relay N, the ranks are behind simulated relays of N ranks each (a trainer host): each
relay speaks the real relay protocol to the coordinator (relay_hello, one heartbeat, its ranks'
messages gathered in relay_up, the coordinator's to them in relay_down) and has one data socket
that workers push its ranks' pieces to; it hands them to its ranks in-process (what `msd relay`
does over ipc), so that thousands of ranks fit on one small machine.

    python tools/scale_ranks.py --coordinator ADDR --ranks A:B --steps N --out FILE.json [--step-s S] [--per-relay N]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import orjson
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402

from msd_common import protocol as P  # noqa: E402
from msd_common import wire  # noqa: E402
from msd_common.topology import Topology  # noqa: E402
from relay.core import step_headers  # noqa: E402
from trainer_client.receiving import End, Forgotten, ReceivingState, Welcomed  # noqa: E402
from msd_common.session import Registration  # noqa: E402
from msd_common.sockets import make_socket, send_nowait, waiting  # noqa: E402


class LightRank:
    def __init__(self, ctx: zmq.Context, rank: int, coordinator: str, pace: "Pace",
                 relay: "SimRelay | None" = None, loss_sources: int = 0) -> None:
        self.rank = rank
        self.pace = pace
        self.loss_sources = loss_sources  # report a training loss for this many sources (mixture.adapt)
        self.relay = relay
        self.ready: collections.deque[int] = collections.deque()  # finished steps not consumed yet
        self.state = ReceivingState(rank, 0, 0, None)
        if relay is not None:  # its sockets are the relay's
            self.control = self.data = None
            self.registration = Registration(lambda: self._hello(relay.address), lambda: None)
            self.registration.welcomed(1.0)  # the relay says hello for it, and beats for it
            self.first_batch_at: float | None = None
            self.steps_done = 0
            self.ended = False
            return
        self.control = make_socket(ctx, zmq.DEALER)
        self.data = make_socket(ctx, zmq.PULL, hwm=10_000)
        port = self.data.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
        incarnation = int.from_bytes(os.urandom(6), "little")
        self.registration = Registration(
            lambda: P.TrainerHello(version=P.PROTOCOL_VERSION, rank=rank, data_address=address,
                                   resume_step=self.state.step, incarnation=incarnation, metadata_only=0),
            lambda: P.TrainerHeartbeat(rank=rank))
        self.control.connect(coordinator)
        self.first_batch_at: float | None = None
        self.steps_done = 0
        self.ended = False

    def _losses(self, step: int) -> dict:
        """What DataClient.report_loss sends with a consumed: the step before's sums per source."""
        if not self.loss_sources or step < 0:
            return {}
        sources = list(range(self.loss_sources))
        return {"loss_step": step, "loss_sources": sources, "loss_tokens": [64] * len(sources),
                "loss_sums": [64 * (2.0 + 0.1 * s + 0.01 * (self.rank % 7)) for s in sources]}

    def _hello(self, address: str) -> P.TrainerHello:
        return P.TrainerHello(version=P.PROTOCOL_VERSION, rank=self.rank, data_address=address,
                              resume_step=self.state.step, incarnation=self.rank, metadata_only=0)

    def _send(self, message: P.Message) -> None:
        if self.relay is not None:
            self.relay.up(message)
        else:
            send_nowait(self.control, message)

    def on_control(self, frames: list | None = None) -> None:
        for out in self.state.on_control(frames if frames is not None else self.control.recv_multipart(copy=False)):
            if isinstance(out, Welcomed):
                self.registration.welcomed(out.heartbeat_s)
            elif isinstance(out, Forgotten):
                if self.relay is not None:
                    self.relay.up(self._hello(self.relay.address))
                else:
                    self.registration.forgotten()
            elif isinstance(out, (End, Exception)):
                self.ended = True

    def on_data(self) -> None:
        for frames in waiting(self.data):
            self.state.on_pieces(frames)

    def turn(self, now: float) -> None:
        for item in self.state.finished():  # finished steps (whose micro-batches a trainer would build)
            if isinstance(item, End):
                self.ended = True
                continue
            self.ready.append(item.step)
        while self.ready and self.pace.due(self.ready[0], now):
            step = self.ready.popleft()
            if self.first_batch_at is None:
                self.first_batch_at = time.time()
            self._send(P.Consumed(rank=self.rank, step=step, waited_s=0.0, compute_step=-1, compute_s=[],
                                  **self._losses(step - 1)))
            self.registration.spoke(now)
            self.steps_done = step + 1
        if self.relay is None:
            msg = self.registration.due(now)
            if msg is not None:
                send_nowait(self.control, msg)

    def close(self) -> None:
        if self.relay is not None:
            return
        if self.registration.registered:
            send_nowait(self.control, P.TrainerBye(rank=self.rank))
        self.control.close(linger=200)
        self.data.close(linger=0)


class SimRelay:
    """A trainer host's relay, simulated where it meets its ranks (in-process) and real where it
    meets the coordinator and the workers (relay/process.py's protocol): one hello and one
    heartbeat for the host, its ranks' `consumed` of a step gathered in one relay_up."""

    def __init__(self, ctx: zmq.Context, coordinator: str, index: int) -> None:
        self.control = make_socket(ctx, zmq.DEALER)
        self.data = make_socket(ctx, zmq.PULL, hwm=10_000)
        self.address = f"tcp://127.0.0.1:{self.data.bind_to_random_port('tcp://127.0.0.1')}"
        self.ranks: dict[int, LightRank] = {}
        self.by_dp: dict[int, list[LightRank]] = {}
        self.topology: Topology | None = None
        self.relay_id: int | None = None
        self.queue: list[P.Message] = []
        self.consumed: list[tuple[int, int]] = []  # (rank, step) rows of relay_up's table
        self.losses: list[tuple[int, int, int, int]] = []  # (rank, step, source, tokens) rows
        self.loss_sums: list[float] = []
        self.held: dict[int, list[P.Consumed]] = {}
        self.registration = Registration(
            lambda: P.RelayHello(version=P.PROTOCOL_VERSION, host=f"sim-{index}", data_address=self.address,
                                 local=f"ipc://sim-{index}", incarnation=index),
            lambda: P.RelayHeartbeat(relay_id=self.relay_id or 0, ranks=sorted(self.ranks)))
        self.control.connect(coordinator)

    def up(self, message: P.Message) -> None:
        if isinstance(message, P.Consumed):  # gathered: the host's ranks of a step go up together
            held = self.held.setdefault(message.step, [])
            held.append(message)
            if len(held) == len(self.ranks):
                for m in self.held.pop(message.step):
                    self.consumed.append((m.rank, m.step))
                    for source, total, tokens in zip(m.loss_sources, m.loss_sums, m.loss_tokens):
                        self.losses.append((m.rank, m.loss_step, source, tokens))
                        self.loss_sums.append(total)
        else:
            self.queue.append(message)

    def on_control(self) -> None:
        msg = wire.receive(self.control.recv_multipart(copy=False), P.RELAY_INBOX)
        if isinstance(msg, P.RelayWelcome):
            self.registration.welcomed(float(msg.heartbeat_s))
            self.relay_id, self.topology = msg.relay_id, Topology(**msg.topology)
            self.by_dp = {}
            for lr in self.ranks.values():
                self.by_dp.setdefault(self.topology.coords(lr.rank).dp, []).append(lr)
            self.queue = [lr._hello(self.address) for lr in self.ranks.values()]
        elif isinstance(msg, P.RelayDown):
            view, at = memoryview(msg.blob).cast("B"), 0
            for rank, header, sizes in msg.parts:
                frames = [msgpack.packb(header)]
                for n in sizes:
                    frames.append(view[at:at + n])
                    at += n
                self.ranks[rank].on_control(frames)
        elif isinstance(msg, P.RelayStep):
            for rank, frames in step_headers(msg):
                self.ranks[rank].on_control(frames)
        elif isinstance(msg, P.UnknownPeer):
            self.registration.forgotten()

    def on_data(self) -> None:
        for frames in waiting(self.data):
            rank = wire.unpack_header(frames[0].buffer)["rank"]
            for lr in self.by_dp.get(self.topology.coords(rank).dp, ()):
                lr.state.on_pieces(frames)

    def turn(self, now: float) -> None:
        msg = self.registration.due(now)
        if msg is not None:
            send_nowait(self.control, msg)
        if (self.queue or self.consumed) and self.registration.registered:
            self._up(self.queue, self.consumed)
            self.queue, self.consumed = [], []

    def _up(self, messages: list[P.Message], consumed: list[tuple[int, int]]) -> None:
        losses = {"losses": np.array(self.losses, dtype=np.int64).reshape(-1, 4),
                  "loss_sums": np.array(self.loss_sums, dtype=np.float64)} if self.losses else {}
        self.losses, self.loss_sums = [], []
        send_nowait(self.control, P.RelayUp(relay_id=self.relay_id, messages=[m.header() for m in messages],
                                            ranks=sorted(self.ranks),
                                            consumed=np.array(consumed, dtype=np.int64).reshape(-1, 2),
                                            waited_s=np.zeros(len(consumed)), **losses))
        self.registration.spoke(time.monotonic())

    def close(self) -> None:
        if self.registration.registered:
            self._up([P.TrainerBye(rank=r) for r in self.ranks], [])
        self.control.close(linger=200)
        self.data.close(linger=0)


class Pace:
    """When a step may be consumed: at once, or step_s x (step - first step) after the process
    consumed its first step."""

    def __init__(self, step_s: float | None) -> None:
        self.step_s = step_s
        self.origin: tuple[int, float] | None = None  # (first step consumed here, when)

    def due(self, step: int, now: float) -> bool:
        if not self.step_s:
            return True
        if self.origin is None:
            self.origin = (step, now)
        return now >= self.origin[1] + (step - self.origin[0]) * self.step_s


def run(coordinator: str, first: int, last: int, steps: int, timeout_s: float, step_s: float | None = None,
        per_relay: int = 0, loss_sources: int = 0) -> dict:
    ctx = zmq.Context()
    pace = Pace(step_s)
    relays = [SimRelay(ctx, coordinator, i) for i in range(first // per_relay, -(-last // per_relay))] \
        if per_relay else []
    ranks = [LightRank(ctx, r, coordinator, pace, relays[(r - first) // per_relay] if per_relay else None,
                       loss_sources) for r in range(first, last)]
    for lr in ranks:
        if lr.relay is not None:
            lr.relay.ranks[lr.rank] = lr
    poller = zmq.Poller()
    owner = {}
    for peer in relays or ranks:
        poller.register(peer.control, zmq.POLLIN)
        poller.register(peer.data, zmq.POLLIN)
        owner[peer.control] = (peer, peer.on_control)
        owner[peer.data] = (peer, peer.on_data)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for sock, _ in poller.poll(50):
                owner[sock][1]()
            now = time.monotonic()
            for lr in ranks:
                lr.turn(now)
            for relay in relays:
                relay.turn(now)
            if all(lr.steps_done >= steps or lr.ended for lr in ranks):
                break
    finally:
        for peer in (*relays, *ranks):
            peer.close()
        ctx.term()
    return {"ranks": [first, last], "steps_done": min(lr.steps_done for lr in ranks),
            "first_batch_at": min((lr.first_batch_at for lr in ranks if lr.first_batch_at), default=None),
            "duplicates": sum(lr.state.duplicates for lr in ranks)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--coordinator", required=True)
    ap.add_argument("--ranks", required=True, help="A:B, ranks A to B-1")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--timeout-s", type=float, default=600)
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-s", type=float, default=None, help="consume a step every S seconds at most")
    ap.add_argument("--per-relay", type=int, default=0, help="ranks per simulated relay (0: ranks speak directly)")
    ap.add_argument("--loss-sources", type=int, default=0, help="report a training loss per source (this many)")
    args = ap.parse_args()
    first, last = (int(x) for x in args.ranks.split(":"))
    result = run(args.coordinator, first, last, args.steps, args.timeout_s, args.step_s, args.per_relay,
                 args.loss_sources)
    with open(args.out, "wb") as f:
        f.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
