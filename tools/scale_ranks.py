"""Many light trainer ranks in one process, for tools/bench_scale.py: each speaks the real protocol
(hello, heartbeats, consumed, its own data socket) and runs the real `ReceivingState` (decoding,
recipe checks, deduplication, each step's tokens copied into place), but hands nothing to a
trainer and builds no micro-batches (a DataClient builds each in the trainer's thread when it is
taken), so that 1,024 ranks fit on one small machine. One poller serves every rank.
With --step-s, a rank consumes step k no earlier than --step-s x k seconds after its process
consumed its first step, as ranks of a synchronous job finish their steps together.

    python tools/scale_ranks.py --coordinator ADDR --ranks A:B --steps N --out FILE.json [--step-s S]
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

from msd_common import protocol as P  # noqa: E402
from trainer_client.receiving import End, Forgotten, ReceivingState, Welcomed  # noqa: E402
from msd_common.session import Registration  # noqa: E402
from msd_common.sockets import make_socket, send_nowait  # noqa: E402


class LightRank:
    def __init__(self, ctx: zmq.Context, rank: int, coordinator: str, pace: "Pace") -> None:
        self.rank = rank
        self.pace = pace
        self.ready: collections.deque[int] = collections.deque()  # finished steps not consumed yet
        self.state = ReceivingState(rank, 0, 0, None)
        self.control = make_socket(ctx, zmq.DEALER)
        self.data = make_socket(ctx, zmq.PULL, hwm=10_000)
        port = self.data.bind_to_random_port("tcp://127.0.0.1")
        address = f"tcp://127.0.0.1:{port}"
        incarnation = int.from_bytes(os.urandom(6), "little")
        self.registration = Registration(
            lambda: P.make(P.TRAINER_HELLO, version=P.PROTOCOL_VERSION, rank=rank, data_address=address,
                           resume_step=self.state.step, incarnation=incarnation, metadata_only=0, carried=None),
            lambda: P.make(P.TRAINER_HEARTBEAT, rank=rank))
        self.control.connect(coordinator)
        self.first_batch_at: float | None = None
        self.steps_done = 0
        self.ended = False

    def on_control(self) -> None:
        for out in self.state.on_control(self.control.recv_multipart(copy=False)):
            if isinstance(out, Welcomed):
                self.registration.welcomed(out.heartbeat_s)
            elif isinstance(out, Forgotten):
                self.registration.forgotten()
            elif isinstance(out, (End, Exception)):
                self.ended = True

    def on_data(self) -> None:
        for _ in range(1000):
            try:
                frames = self.data.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
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
            send_nowait(self.control, P.make(P.CONSUMED, rank=self.rank, step=step, waited_s=0.0, compute_step=-1,
                                             compute_s=[]))
            self.registration.spoke(now)
            self.steps_done = step + 1
        msg = self.registration.due(now)
        if msg is not None:
            send_nowait(self.control, msg)

    def close(self) -> None:
        if self.registration.registered:
            send_nowait(self.control, P.make(P.TRAINER_BYE, rank=self.rank))
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


def run(coordinator: str, first: int, last: int, steps: int, timeout_s: float, step_s: float | None = None) -> dict:
    ctx = zmq.Context()
    pace = Pace(step_s)
    ranks = [LightRank(ctx, r, coordinator, pace) for r in range(first, last)]
    poller = zmq.Poller()
    owner = {}
    for lr in ranks:
        poller.register(lr.control, zmq.POLLIN)
        poller.register(lr.data, zmq.POLLIN)
        owner[lr.control] = (lr, lr.on_control)
        owner[lr.data] = (lr, lr.on_data)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            for sock, _ in poller.poll(50):
                owner[sock][1]()
            now = time.monotonic()
            for lr in ranks:
                lr.turn(now)
            if all(lr.steps_done >= steps or lr.ended for lr in ranks):
                break
    finally:
        for lr in ranks:
            lr.close()
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
    args = ap.parse_args()
    first, last = (int(x) for x in args.ranks.split(":"))
    result = run(args.coordinator, first, last, args.steps, args.timeout_s, args.step_s)
    with open(args.out, "wb") as f:
        f.write(orjson.dumps(result))


if __name__ == "__main__":
    main()
