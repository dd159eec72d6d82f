"""Worker metrics (`msd worker --metrics-port PORT`), with prometheus-client's multiprocess mode:
each worker process writes its values to files in a directory the host agent made, and the agent
serves them all on one port (worker processes come and go; one scrape target per host stays).

Enabled in a worker process when the agent set MSD_WORKER_METRICS (and PROMETHEUS_MULTIPROC_DIR)
before forking its fork server (worker/forks.py); prometheus-client is imported only then.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from msd_common import health

ENABLED_ENV = "MSD_WORKER_METRICS"


class WorkerMetrics:
    """One worker process's metrics (counters summed over the host's processes; gauges per pid)."""

    def __init__(self, registry: Any = None) -> None:
        """`registry`: prometheus-client's default one unless given (the docs list the metrics on one of their own)."""
        import functools

        import prometheus_client

        on = {"registry": registry} if registry is not None else {}
        Counter = functools.partial(prometheus_client.Counter, **on)
        Gauge = functools.partial(prometheus_client.Gauge, **on)
        self.records = Counter("msd_worker_records_prepared", "Records prepared (read and transformed), by source",
                               ["source"])
        self.tokens = Counter("msd_worker_tokens_prepared", "Tokens of the records prepared, by source", ["source"])
        self.prepare_seconds = Counter("msd_worker_prepare_seconds", "Seconds spent preparing records, by source",
                                       ["source"])
        self.seconds_per_token = Gauge("msd_worker_seconds_per_token", "Seconds per token of this process's last "
                                       "prepare task of each source", ["source"], multiprocess_mode="liveall")
        self.busy = Counter("msd_worker_busy_seconds", "Seconds spent on prepare and deliver work")
        self.busy_share = Gauge("msd_worker_busy_share", "Share of the last heartbeat interval this process was busy",
                                multiprocess_mode="liveall")
        self.pieces = Counter("msd_worker_pieces_sent", "Document pieces sent to trainer ranks")
        self.send_waits = Counter("msd_worker_send_waits", "Sends that found a rank's socket full (kept in the "
                                  "outbox, sent when it drains)")
        self.storage_bytes = Counter("msd_worker_storage_bytes", "Bytes fetched from object stores (ranged reads)")
        self.storage_requests = Counter("msd_worker_storage_requests", "Ranged requests to object stores")
        self.storage_retries = Counter("msd_worker_storage_retries", "Requests to object stores asked again after a "
                                       "transient error (timeout, 5xx, throttling)")
        self._last: tuple[float, float, int] | None = None  # (time, busy seconds, send waits) at the last sample
        self._storage_last = (0, 0, 0)

    def prepared(self, source: str, records: int, tokens: int, seconds: float) -> None:
        self.records.labels(source).inc(records)
        self.tokens.labels(source).inc(tokens)
        self.prepare_seconds.labels(source).inc(seconds)
        if tokens:
            self.seconds_per_token.labels(source).set(seconds / tokens)

    def sample(self, now: float, busy_s: float, send_waits: int) -> None:
        """Called about once a second: busy share and send waits since the last call."""
        if self._last is not None:
            then, busy_then, waits_then = self._last
            if busy_s >= busy_then and now > then:
                self.busy.inc(busy_s - busy_then)
                self.busy_share.set(min(1.0, (busy_s - busy_then) / (now - then)))
            if send_waits > waits_then:
                self.send_waits.inc(send_waits - waits_then)
        self._last = (now, busy_s, send_waits)
        from msd_common.formats.storage import totals

        current = totals()
        for counter, value, before in zip((self.storage_bytes, self.storage_requests, self.storage_retries), current,
                                          self._storage_last):
            if value > before:
                counter.inc(value - before)
        self._storage_last = current


def worker_metrics() -> WorkerMetrics | None:
    return WorkerMetrics() if os.environ.get(ENABLED_ENV) else None


class HostMetricsServer:
    """The host agent's side: the directory the worker processes write to, and the HTTP server
    that aggregates it. Create before the fork server is forked (its children inherit the
    environment), serve() after (a thread: the fork server is forked with none)."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.port, self.host = port, host
        self.health = health.Health()  # /healthz, /readyz: the agent's loop turning, registered
        self.server = None
        self.directory = tempfile.mkdtemp(prefix="msd-worker-metrics-")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = self.directory
        os.environ[ENABLED_ENV] = "1"

    def serve(self) -> None:
        from prometheus_client import CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self.directory)
        self.server = health.serve(self.port, self.host, self.health, registry)

    def process_gone(self, pid: int) -> None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, self.directory)

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
        shutil.rmtree(self.directory, ignore_errors=True)


def prepared_tokens(actions: list[Any]) -> int:
    """Tokens in the `prepared` answer among a prepare's actions (its lengths array)."""
    from msd_common.protocol import Prepared

    for a in actions:
        if isinstance(getattr(a, "message", None), Prepared):
            return int(a.message.lengths.sum())
    return 0
