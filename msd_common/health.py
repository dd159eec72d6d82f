"""The HTTP endpoint of a long-running msd process: Prometheus metrics and the health answers an
orchestrator asks for (Kubernetes' probes, a load balancer's checks).

- `/metrics`: the process's registry, as prometheus-client serves it.
- `/healthz` (liveness): 200 while the process's main loop is turning; 503 once it has not
  reported for `stall_s` (a wedged loop: restarting the process is the cure). Before the loop
  first reports (a coordinator replaying its journal or indexing a new corpus) it answers 200:
  a long start is not a hang.
- `/readyz` (readiness): 200 once the process does its job (a coordinator serving or standing
  by, a worker host registered), 503 before; the body says which, as JSON.

One thread of the standard library's WSGI server; the loop only stores a timestamp.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Iterable

import orjson

STALL_S = 60.0


class Health:
    """What the loop reports: its last turn and what the process is doing now."""

    def __init__(self, stall_s: float = STALL_S) -> None:
        self.stall_s = stall_s
        self.role = "starting"  # what /readyz tells: starting, standby, active, registered, ...
        self.ready = False
        self._beat: float | None = None

    def beat(self) -> None:
        self._beat = time.monotonic()

    def set(self, role: str, ready: bool) -> None:
        self.role, self.ready = role, ready

    def alive(self) -> tuple[bool, str]:
        if self._beat is None:
            return True, "loop not started"
        quiet = time.monotonic() - self._beat
        if quiet > self.stall_s:
            return False, f"main loop silent for {quiet:.0f}s (more than {self.stall_s:.0f}s)"
        return True, f"main loop turned {quiet:.1f}s ago"


def serve(port: int, host: str, health: Health, registry: Any = None) -> Any:
    """Serve /metrics (of `registry`, if given), /healthz and /readyz on host:port in a daemon
    thread; returns the server (server.shutdown() stops it)."""
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: no access log
            pass

    metrics_app = make_wsgi_app(registry) if registry is not None else None

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics" and metrics_app is not None:
            return metrics_app(environ, start_response)
        if path == "/healthz":
            ok, why = health.alive()
            return _answer(start_response, ok, {"alive": ok, "why": why, "role": health.role})
        if path == "/readyz":
            ok = health.ready and health.alive()[0]
            return _answer(start_response, ok, {"ready": ok, "role": health.role})
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"msd: /metrics, /healthz or /readyz\n"]

    server = make_server(host, port, app, ThreadingWSGIServer, handler_class=Quiet)
    threading.Thread(target=server.serve_forever, name="msd-http", daemon=True).start()
    return server


def _answer(start_response: Callable, ok: bool, body: dict) -> list[bytes]:
    start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
    return [orjson.dumps(body) + b"\n"]
