"""Simulated time and a simulated network: one event queue, ordered by (time, sequence number), so
that a seed gives the same order of everything, every time.

The network keeps ZeroMQ's one promise: messages on one connection (a sender and a receiver)
arrive in the order sent. Across connections nothing is ordered: each message takes its own
delay. A process that stops (a crash, a stop) loses what was on its way to it, and messages it
sent that had not arrived yet are lost too (the pessimistic case: still in its socket's queue).
That is the case the coordinator keeps acknowledged deliveries for until their step is consumed:
a worker's ack says its socket queued the pieces, not that they arrived."""

from __future__ import annotations

import hashlib
import heapq
import random
from typing import Any, Callable


class World:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = 0
        self.nodes: dict[str, Any] = {}  # address -> the node listening there (absent: nobody)
        self._last_arrival: dict[tuple[str, str], float] = {}  # FIFO per connection
        self.delay_s = (0.0005, 0.002)  # the network's delay: base, and mean of the extra
        self.duplicate_p = 0.0  # chance a data message (pieces) arrives twice (a resend)
        # (from, to) -> (until, whether the sender sees the loss): messages lost until then
        self.blocked: dict[tuple[str, str], tuple[float, bool]] = {}
        self.congested: dict[tuple[str, str], tuple[float, float]] = {}  # (from, to) -> (until, extra delay)
        self.trace: list[str] = []
        self._digest = hashlib.blake2b(digest_size=16)
        self.events = 0

    # ------------------------------------------------------------------ time

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        self._seq += 1
        heapq.heappush(self._queue, (max(when, self.now), self._seq, fn, args))

    def after(self, seconds: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + seconds, fn, *args)

    def run_until(self, until: float, done: Callable[[], bool], check: Callable[[], None]) -> bool:
        """Run events until `until` (simulated seconds) or until done(); check() after every event.
        Returns done()."""
        while self._queue:
            when, _, fn, args = self._queue[0]
            if when > until:
                break
            heapq.heappop(self._queue)
            self.now = when
            fn(*args)
            self.events += 1
            check()
            if done():
                return True
        self.now = max(self.now, until)
        return done()

    # ------------------------------------------------------------------ the trace

    def log(self, what: str) -> None:
        line = f"{self.now:10.4f} {what}"
        self.trace.append(line)
        self._digest.update(line.encode())

    @property
    def digest(self) -> str:
        return self._digest.hexdigest()

    # ------------------------------------------------------------------ the network

    def send(self, src: str, dst: str, frames: list, data: bool = False) -> bool:
        """Frames from the node at `src` to the address `dst`: they arrive after the network's delay,
        in order with the others on this connection; lost if nobody listens at dst by then, or if
        the connection is broken. False: the sender's queue dropped them (it sees that at once)."""
        node = self.nodes.get(dst)
        if node is None:
            return True
        key = (src, dst)
        if self.blocked:
            until, visible = self.blocked.get(key, (0.0, False))
            if until > self.now:
                return not visible
        base, extra = self.delay_s
        arrive = self.now + base + self.rng.expovariate(1.0 / extra)
        if self.congested:
            until, more = self.congested.get(key, (0.0, 0.0))
            if until > self.now:
                arrive += more
        arrive = max(arrive, self._last_arrival.get(key, 0.0))
        self._last_arrival[key] = arrive
        sender = (self.nodes.get(src), getattr(self.nodes.get(src), "crashes", None))
        self.at(arrive, self._arrive, node, dst, src, frames, sender)
        if data and self.duplicate_p and self.rng.random() < self.duplicate_p:
            again = arrive + self.rng.expovariate(1.0 / (10 * extra))
            self._last_arrival[key] = max(again, arrive)
            self.at(again, self._arrive, node, dst, src, frames, sender)
        return True

    def _arrive(self, node: Any, dst: str, src: str, frames: list, sender: tuple) -> None:
        if self.nodes.get(dst) is not node:  # a process restarted there since: the connection was broken
            return
        origin, crashes = sender
        gone = origin.crashes != crashes if crashes is not None else self.nodes.get(src) is not origin
        if origin is not None and gone:
            return  # its sender crashed first: what it had not yet put on the wire is lost
        if self.blocked:
            until, visible = self.blocked.get((src, dst), (0.0, False))
            if until > self.now and not visible:
                return  # on the wire when the connection broke (a full queue drops only new sends)
        node.receive(src, dst, frames)

    def block(self, src: str, dst: str, until: float, visible: bool = False) -> None:
        """Messages from src to dst are lost until then: a broken connection (visible False: what
        was on its way is lost too), or the sender's full queue dropping them (visible True)."""
        self.blocked[(src, dst)] = (until, visible)

    def congest(self, src: str, dst: str, until: float, extra_s: float) -> None:
        """Messages from src to dst take extra_s longer until then (in order still)."""
        self.congested[(src, dst)] = (until, extra_s)

    def listen(self, address: str, node: Any) -> None:
        self.nodes[address] = node

    def close(self, address: str, node: Any) -> None:
        if self.nodes.get(address) is node:
            del self.nodes[address]
