"""The per-host agent (`msd worker`): starts N worker processes and keeps them running.

Workers are spawned, not forked (forking a process that holds a zmq context crashes), each with
its own context. A worker that dies is restarted with exponential back-off; the agent stops its
workers when it is stopped, and workers exit on their own if the agent disappears.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time

from .loop import run_worker

log = logging.getLogger("msd.worker.host")

MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 10.0  # a process that lived this long before dying restarts without back-off
KILLED = (-signal.SIGKILL, -signal.SIGTERM)  # stopped from outside (operator, OOM killer): no back-off


class HostAgent:
    def __init__(self, coordinator: str, procs: int, log_level: str = "INFO", log_path: str | None = None,
                 keys_dir: str | None = None) -> None:
        if procs < 1:
            raise ValueError("--procs must be >= 1")
        self.coordinator = coordinator
        self.procs = procs
        self.log_level = log_level
        self.log_path = log_path
        self.keys_dir = keys_dir
        self.ctx = mp.get_context("spawn")
        self.children: list[mp.Process | None] = [None] * procs
        self.restarts = [0] * procs
        self.started_at = [0.0] * procs
        self.next_start = [0.0] * procs
        self.stopping = False

    def _start(self, slot: int) -> None:
        p = self.ctx.Process(target=run_worker, args=(self.coordinator, os.getpid(), self.log_level, self.log_path,
                                                      self.keys_dir),
                             name=f"msd-worker-{slot}", daemon=True)
        p.start()
        self.children[slot] = p
        self.started_at[slot] = time.monotonic()
        log.info("started worker process %d (pid %d)", slot, p.pid)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        for slot in range(self.procs):
            self._start(slot)
        try:
            while not self.stopping:
                now = time.monotonic()
                for slot, p in enumerate(self.children):
                    if p is not None and p.is_alive():
                        continue
                    if p is not None:
                        if now - self.started_at[slot] >= HEALTHY_AFTER_S or p.exitcode in KILLED:
                            self.restarts[slot] = 0  # it ran fine for a while, or was killed: not a crash loop
                        self.restarts[slot] += 1
                        backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** (self.restarts[slot] - 1))
                        log.warning("worker process %d exited with %s; restarting in %.1fs", slot, p.exitcode, backoff)
                        self.children[slot] = None
                        self.next_start[slot] = now + backoff
                    elif now >= self.next_start[slot]:
                        self._start(slot)
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()

    def stop(self) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        for p in self.children:
            if p is not None and p.is_alive():
                p.terminate()
        for p in self.children:
            if p is not None:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
