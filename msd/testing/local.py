"""Run a whole job on this machine: a coordinator process and a worker host agent process on
loopback. Used by `msd demo`, the integration tests and the benchmarks; trainer processes are
started by the caller, since what they do with the batches is theirs to decide."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import signal
import threading
import time
from typing import Any

from msd_common.logs import setup_logging

from .ports import free_address

_SPAWN = mp.get_context("spawn")


def _coordinator_main(job_path: str, bind: str, addr_queue: Any, log_level: str, log_path: str | None,
                      state_dir: str | None = None, standby: bool = False) -> None:
    setup_logging(log_level, "coordinator" if not standby else "standby", log_path)
    from coordinator.app import Coordinator
    from coordinator.serving import counted_sources, take_lease
    from msd_common.spec import load_job
    from coordinator.sources import open_as_coordinator

    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        job = load_job(job_path)
        sources = open_as_coordinator(job)
    except Exception as e:
        addr_queue.put(("error", str(e)))
        return

    lease = take_lease(job, bind, state_dir, standby)
    told = []  # the address goes out once: when the counting phase listens, else when the coordinator does

    def tell(address: str) -> None:
        if not told:
            told.append(address)
            addr_queue.put(("ok", address))

    try:
        sources, router = counted_sources(job, sources, bind, lease, tell)
    except Exception as e:  # a source the workers could not open
        if not told:
            addr_queue.put(("error", str(e)))
        raise
    if sources is None:
        return

    async def main() -> None:
        coord = Coordinator(job, sources, bind, state_dir, lease=lease, router=router)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, coord.terminate)
        ready = loop.create_future()
        ready.add_done_callback(lambda f: tell(f.result()))
        await coord.run(ready)
        if coord.failed:
            raise SystemExit(1)

    asyncio.run(main())


def _host_main(address: str, procs: int | None, log_level: str, log_path: str | None, keys_dir: str | None = None,
               max_procs: int | None = None) -> None:
    setup_logging(log_level, "worker-host", log_path)
    from worker.host import HostAgent

    raise SystemExit(HostAgent(address, procs, log_level, log_path, keys_dir, max_procs).run())


class LocalJob:
    """Context manager: `with LocalJob(path, workers=3) as job: job.address ...`."""

    def __init__(self, job_path: str, workers: int | None = 1, log_level: str = "WARNING",
                 bind: str = "tcp://127.0.0.1:0", log_path: str | None = None, state_dir: str | None = None,
                 worker_keys: str | None = None, max_procs: int | None = None, standby: bool = False) -> None:
        """workers: processes on the (one, local) worker host; None: `--procs auto` up to max_procs;
        0: no local worker host (workers come from elsewhere); standby: a second coordinator
        process with --standby on the same state dir (then `address` lists both)."""
        self.standby = standby
        self.standby_process: mp.Process | None = None
        self.max_procs = max_procs
        self.log_path = log_path
        self.worker_keys = worker_keys
        self.state_dir = state_dir
        self.job_path = job_path
        self.workers = workers
        self.log_level = log_level
        self.bind = bind
        self.address: str | None = None
        self.coordinator: mp.Process | None = None
        self.host: mp.Process | None = None

    def __enter__(self) -> "LocalJob":
        self.address = self.primary_address = self._start_coordinator(self.bind)
        if self.standby:
            self.standby_address = free_address()
            self._standby_queue = _SPAWN.Queue()  # kept: the child unpickles it after start()
            self.standby_process = _SPAWN.Process(
                target=_coordinator_main, name="msd-standby",
                args=(self.job_path, self.standby_address, self._standby_queue, self.log_level, self.log_path,
                      self.state_dir, True))
            self.standby_process.start()
            self.address = f"{self.primary_address},{self.standby_address}"
        if self.workers == 0:
            return self
        self.host = _SPAWN.Process(target=_host_main, args=(self.address, self.workers, self.log_level, self.log_path,
                                                           self.worker_keys, self.max_procs),
                                   name="msd-worker-host")
        self.host.start()
        return self

    def _start_coordinator(self, bind: str) -> str:
        q = _SPAWN.Queue()
        self.coordinator = _SPAWN.Process(target=_coordinator_main, name="msd-coordinator",
                                          args=(self.job_path, bind, q, self.log_level, self.log_path, self.state_dir))
        self.coordinator.start()
        status, value = q.get(timeout=120)
        if status != "ok":
            self.coordinator.join(5)
            raise RuntimeError(f"coordinator failed to start: {value}")
        return value

    def restart_coordinator(self) -> None:
        """SIGKILL the coordinator and start a new one on the same address and state dir."""
        self.coordinator.kill()
        self.coordinator.join(10)
        self._start_coordinator(self.address)

    def worker_pids(self) -> list[int]:
        """PIDs of the host agent's worker processes (children of its fork server)."""
        from worker.forks import host_worker_pids

        return host_worker_pids(self.host.pid)

    def __exit__(self, *exc) -> None:
        for p in (self.host, self.coordinator, self.standby_process):
            if p is not None and p.is_alive():
                p.terminate()
        for p in (self.host, self.coordinator, self.standby_process):
            if p is not None:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=5)


def serve_in_thread(coordinator: Any) -> tuple[asyncio.AbstractEventLoop, threading.Thread, str]:
    """Run a Coordinator (app.Coordinator) in this process, its loop in a thread, for a test that
    needs to reach into it: (loop, thread, address). Stop it with
    `loop.call_soon_threadsafe(coordinator.terminate)` and join the thread."""
    loop = asyncio.new_event_loop()
    ready = loop.create_future()
    thread = threading.Thread(target=loop.run_until_complete, args=(coordinator.run(ready),), daemon=True)
    thread.start()
    while not ready.done():
        time.sleep(0.001)
    return loop, thread, ready.result()
