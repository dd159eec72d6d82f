"""Building the trainer's next micro-batch while it computes on the current one.

`next()` hands out micro-batch m and asks for m + 1 (or the first of the next step, when that
step is already in); a builder thread builds it while the trainer computes, so the next `next()`
only takes it. Building one costs 50-250 us of CPU (more when the host's cores are busy, as they
are the moment every rank leaves its step's barrier together): inside `next()` that was the
trainer's whole data wait once the data had arrived. One micro-batch is built ahead, no more: a
built micro-batch takes 7-14x the memory of the received tokens it comes from.

A micro-batch is asked for only when the trainer, the last time it took a micro-batch of the
same index in its step, went on to compute for longer than two builds: with no compute between
calls (a data-loading benchmark, a trainer that gathers a whole step's micro-batches before it
computes) there is no time to build ahead in, and a build in the other thread would only compete
with the trainer's own (tools/bench_next.py: 83 against 57 us a call at 4,096 tokens). The time
after a step's last micro-batch (the optimizer step, the ranks' barrier) is told apart from the
time between two micro-batches of a step, since they differ.

The trainer never waits for the builder longer than one build: if the builder has not started
the micro-batch asked for, the trainer builds it itself (with no compute between two `next()`
calls, that is the common case, and it costs no hand-over); if the builder is building it, the
trainer waits for that build to finish rather than start a second one. The builder also forwards
the trainer's commands (consumed, state, close) to the client's I/O thread, since it owns the
trainer's end of their pipe: `next()` only puts items on a queue (sending `consumed` from the
trainer's thread took 53 us of its `next()` at the end of every step, measured on 8 ranks).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable

from .buffers import NoSpareBuffer

log = logging.getLogger("msd.client")

SPARE_TRIES, SPARE_WAIT_S = 20, 0.0005  # waiting for a buffer the trainer frees (then the trainer builds)


class _Job:
    __slots__ = ("ready", "m", "lock", "batch", "taken")

    def __init__(self, ready: Any, m: int) -> None:
        self.ready, self.m = ready, m
        self.lock = threading.Lock()
        self.batch: Any = None
        self.taken = False


class Prebuilder:
    def __init__(self, build: Callable[[Any, int, bool], Any], send: Callable[[list], None], name: str) -> None:
        """build(ready_step, m, ahead): the micro-batch as the trainer gets it (ahead: in the
        builder's thread, which may raise NoSpareBuffer). send(cmd): a command to the
        I/O thread, called from the builder's thread only (its socket belongs to that thread)."""
        self._build = build
        self._send = send
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._job: _Job | None = None  # the micro-batch asked for, touched by the trainer's thread only
        self.built_ahead = 0  # micro-batches the trainer found built (the latency benchmark reads it)
        self._build_s = 0.0  # how long the last build took
        self._left_at: float | None = None  # when the trainer last went back to its compute
        self._taken_m = -1  # the index in its step of the micro-batch it took last
        self._computed: dict[int, float] = {}  # index in the step -> the trainer's time after taking it, last seen
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the trainer's thread

    def ask(self, ready: Any, m: int) -> None:
        """Build micro-batch m of `ready` ahead (the one the trainer will take next), if the
        trainer computes long enough between its calls for that to help."""
        self._left_at = time.perf_counter()
        if self._computed.get(self._taken_m, 0.0) <= 2 * self._build_s:
            return
        job = _Job(ready, m)
        self._job = job
        self._items.put(job)

    def command(self, cmd: list) -> None:
        """A command for the I/O thread, sent after the builds and commands asked before it."""
        self._items.put(cmd)

    def call(self, work: Callable[[], Any]) -> None:
        """Housekeeping for the builder's thread, after what was asked before it (giving freed
        heap pages back: not in the trainer's next())."""
        self._items.put(work)

    def take(self, ready: Any, m: int) -> Any:
        """Micro-batch m of `ready`: the one built ahead, or built now."""
        if self._left_at is not None:
            self._computed[self._taken_m] = time.perf_counter() - self._left_at
        self._taken_m = m
        job, self._job = self._job, None
        if job is None or job.ready is not ready or job.m != m:
            return self._timed_build(ready, m)
        with job.lock:  # held by the builder only while it builds this very micro-batch
            job.taken = True
            batch, job.batch = job.batch, None
        if batch is None:  # not started, or it failed (building it here raises the error in the trainer)
            return self._timed_build(ready, m)
        self.built_ahead += 1
        return batch

    def _timed_build(self, ready: Any, m: int, ahead: bool = False) -> Any:
        started = time.perf_counter()
        batch = self._build(ready, m, ahead)
        self._build_s = time.perf_counter() - started
        return batch

    def close(self, timeout: float = 10.0) -> None:
        self._items.put(None)
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the builder's thread

    def _run(self) -> None:
        while True:
            item = self._items.get()
            if item is None:
                return
            if isinstance(item, list):
                self._send(item)
                continue
            if not isinstance(item, _Job):
                try:
                    item()
                except Exception:  # housekeeping never stops the builder (it forwards the commands)
                    log.warning("the client's housekeeping failed", exc_info=True)
                continue
            for _ in range(SPARE_TRIES):
                if not item.lock.acquire(blocking=False):
                    break  # the trainer is taking it
                try:
                    if not item.taken:
                        item.batch = self._timed_build(item.ready, item.m, ahead=True)
                    break
                except NoSpareBuffer:  # the trainer is about to drop its previous micro-batch
                    pass
                except Exception:  # the trainer builds it again and gets the error itself
                    log.debug("building a micro-batch ahead failed", exc_info=True)
                    break
                finally:
                    item.lock.release()
                time.sleep(SPARE_WAIT_S)
