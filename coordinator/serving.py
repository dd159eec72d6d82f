"""Starting the coordinator: the lease on the state dir, the stop signals, the record counts from
the workers (counting.py, on a cold start with `runtime.index_on: workers`), then the coordinator
proper (app.py) on the same control socket. Apart from app.py so that the counting listens
before the coordinator's own modules are imported: the workers start indexing that much sooner.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import signal
import threading
from typing import Callable

from msd_common import health
from msd_common.spec import JobConfig
from .lease import Lease, LeaseHeld
from .router import Router
from .sources import OpenedSources

log = logging.getLogger("msd.coordinator")


def serve(job: JobConfig, sources: OpenedSources, bind: str, state_dir: str | None = None,
          allow_config_change: bool = False, standby: bool = False, metrics_port: int | None = None,
          metrics_host: str = "127.0.0.1") -> None:
    """Run a coordinator until SIGINT/SIGTERM. standby: wait until the coordinator holding the
    state dir's lease is gone, then serve (the state dir on a shared file system)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is a core dependency; tolerate its absence on exotic platforms
        pass
    metrics = None
    if metrics_port is not None:  # before the lease: a standby answers its probes while it waits
        from .metrics import CoordinatorMetrics

        metrics = CoordinatorMetrics()
        metrics.health.stall_s = max(health.STALL_S, 10 * job.runtime.heartbeat_s)
        metrics.serve(metrics_port, metrics_host)
        log.info("Prometheus metrics on http://%s:%d/metrics (and /healthz, /readyz)", metrics_host, metrics_port)
        if standby:
            metrics.health.set("standby", True)
    lease = take_lease(job, bind, state_dir, standby)
    if metrics is not None:
        metrics.health.set("starting", False)  # until the loop's first heartbeat
    # From the counting on until the loop takes them, a stop signal is caught, not left to its
    # default action: SIGTERM would end the process outright, between the counting and the loop,
    # its worker host's processes left behind and its copies unsynced.
    from .counting import catch_stop_signals

    stop: list[int] = []
    previous = catch_stop_signals(stop)
    try:
        if sources.pending:  # the coordinator's modules (~60 ms) load while the workers count
            threading.Thread(target=importlib.import_module, args=("coordinator.app",), name="msd-import",
                             daemon=True).start()
        sources, router = counted_sources(job, sources, bind, lease, stop=stop)
        if sources is None:  # stopped before the workers had counted
            if lease is not None:
                lease.release()
            return

        from .app import Coordinator

        async def main() -> None:
            coord = Coordinator(job, sources, bind, state_dir, allow_config_change, lease, metrics, router)
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, coord.terminate)
            if stop:  # one came in before the loop took them
                coord.terminate()
            await coord.run()
            if coord.failed:
                raise SystemExit(1)

        asyncio.run(main())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def counted_sources(job: JobConfig, sources: OpenedSources, bind: str, lease: Lease | None,
                    on_bound: Callable[[str], None] | None = None,
                    stop: list[int] | None = None) -> tuple[OpenedSources | None, Router | None]:
    """The sources with every record count known: those this host has no index of are counted
    by the workers (runtime.index_on: workers; counting.py), on the socket the coordinator then
    serves on. (None, None) if stopped meanwhile. Raises ConfigError (a source the workers cannot
    open) and LeaseLost."""
    if not sources.pending:
        return sources, None
    from .counting import Stopped, count_on_workers

    try:
        return count_on_workers(job, sources, bind, lease, on_bound, stop)
    except Stopped as e:
        log.info("stopped while the workers were counting (%s)", e)
        return None, None


def take_lease(job: JobConfig, bind: str, state_dir: str | None, standby: bool) -> Lease | None:
    """The lease on the state dir (None without one); a standby blocks here until it is its."""
    if not state_dir:
        if standby:
            raise SystemExit("msd coordinator: --standby needs --state-dir: the primary's, on a shared file system")
        return None
    lease = Lease(state_dir, bind, job.runtime.heartbeat_s)
    try:
        lease.acquire(standby)
    except LeaseHeld as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    return lease
