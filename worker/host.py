"""The per-host agent (`msd worker`): starts worker processes and keeps them running.

The agent imports the worker's modules (`worker/preload.py`) and forks a fork server of its own
before it opens any zmq socket (`worker/forks.py`); the server forks the worker processes, so
the agent, the server and the workers share those modules' memory, and each worker creates its
own zmq context. The server exits once it has had nothing to start for a few seconds, and a
later start gets a fresh one. The workers are the agent's children: a worker that dies is
restarted with exponential back-off; the agent stops its workers when it is stopped, and
workers exit on their own if the agent disappears.

The agent registers with the coordinator (`host_hello`: its process count and limits) and
heartbeats. With `--procs auto` it starts one process and the coordinator grows or shrinks the
count within [1, max_procs] by `scale` messages: a grown host starts processes, a shrunk one
stops the processes the coordinator names (ones it has stopped giving work and that hold
nothing), so no prepared record is lost by scaling down.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time

import zmq

from msd_common import protocol as P
from msd_common import security, wire
from msd_common.errors import ProtocolError
from msd_common.session import PeerLoop, Registration
from msd_common.sockets import make_socket, send_nowait

from .forks import ForkedWorker, ForkServer

log = logging.getLogger("msd.worker.host")

MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 10.0  # a process that lived this long before dying restarts without back-off
KILLED = (-signal.SIGKILL, -signal.SIGTERM)  # stopped from outside (operator, OOM killer): no back-off
HEARTBEAT_S = 1.0


def _worker_main(*args) -> None:
    """Entry point of a worker process (its modules were imported by the agent before the fork)."""
    from .loop import run_worker

    run_worker(*args)


class _Slot:
    def __init__(self) -> None:
        self.process: ForkedWorker | None = None
        self.restarts = 0
        self.started_at = 0.0
        self.next_start = 0.0


class HostAgent:
    def __init__(self, coordinator: str, procs: int | None, log_level: str = "INFO", log_path: str | None = None,
                 keys_dir: str | None = None, max_procs: int | None = None, metrics_port: int | None = None,
                 metrics_host: str = "127.0.0.1") -> None:
        """procs: a fixed process count, or None for `auto` (1 to max_procs, set by the coordinator);
        metrics_port: serve the worker processes' Prometheus metrics there."""
        if procs is not None and procs < 1:
            raise ValueError("--procs must be >= 1")
        self.auto = procs is None
        self.max_procs = max_procs or (os.cpu_count() or 1) if self.auto else procs
        if self.max_procs < 1:
            raise ValueError("--max-procs must be >= 1")
        self.min_procs = 1 if self.auto else procs
        self.target = self.min_procs
        self.coordinator = coordinator
        self.log_level, self.log_path, self.keys_dir = log_level, log_path, keys_dir
        self.agent_id = int.from_bytes(os.urandom(6), "little")
        self.forks = ForkServer(_worker_main, "worker.host:_worker_main")
        self.slots: list[_Slot] = []
        self.stopping = False
        self.registration: Registration | None = None
        self.loop: PeerLoop | None = None
        self.job_failed: str | None = None  # the reason a failed job's coordinator gave, once logged
        self.refused: str | None = None  # why the coordinator will not have this host
        self.control: zmq.Socket | None = None
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        self.metrics = None  # HostMetricsServer, made in run() before the fork server

    def _start(self, slot: _Slot) -> None:
        # The worker marks the task it works on in a cell the fork server reads when it dies; the
        # agent reports that task, so a record that kills whatever reads it is found and
        # quarantined (state._blame).
        p = self.forks.start_worker((self.coordinator, os.getpid(), self.log_level, self.log_path, self.keys_dir,
                                     self.agent_id))
        slot.process, slot.started_at = p, time.monotonic()
        log.info("started a worker process (pid %d); %d running", p.pid, self.running)

    @property
    def running(self) -> int:
        return sum(1 for s in self.slots if s.process is not None and s.process.is_alive())

    def _keep_alive(self, now: float) -> None:
        if self.metrics is not None:
            registered = self.registration.registered
            self.metrics.health.beat()
            self.metrics.health.set("registered" if registered else "connecting", registered)
        self.forks.poll()  # a server that lingered out is waited for
        while len(self.slots) < self.target:
            self.slots.append(_Slot())
        for slot in self.slots:
            p = slot.process
            if p is not None and p.is_alive():
                overran = p.overrun_s()
                if overran > 0 and not p.overran_s:
                    cell = p.working_on()
                    what = (f"one sample (source {cell.source}, record {cell.record})" if cell.record >= 0 else
                            "loading the job's processor")
                    log.error("worker process %d: %s ran past the source's max_sample_s; stopping the process",
                              p.pid, what)
                    p.stop_overrun(overran)
                continue
            if p is not None:
                if now - slot.started_at >= HEALTHY_AFTER_S or p.exitcode in KILLED:
                    slot.restarts = 0  # it ran fine for a while, or was killed: not a crash loop
                slot.restarts += 1
                backoff = min(MAX_BACKOFF_S, 0.5 * 2 ** (slot.restarts - 1))
                task = p.task
                if p.overran_s:
                    slot.restarts, backoff = 0, 0.0  # the record was at fault, not the process
                else:
                    log.warning("worker process %d exited with %s%s; restarting in %.1fs", p.pid, p.exitcode,
                                f" while preparing task {task}" if task >= 0 else "", backoff)
                self._report(P.WorkerExited(agent_id=self.agent_id, pid=p.pid, exitcode=p.exitcode, task_id=task,
                                            source=p.source, record=p.record, overran_s=p.overran_s))
                if self.metrics is not None:
                    self.metrics.process_gone(p.pid)
                slot.process = None
                slot.next_start = now + backoff
            elif now >= slot.next_start:
                try:
                    self._start(slot)
                except (RuntimeError, OSError) as e:  # no server could start it: tried again after a back-off
                    slot.restarts += 1
                    slot.next_start = now + min(MAX_BACKOFF_S, 0.5 * 2 ** (slot.restarts - 1))
                    log.error("%s; trying again in %.1fs", e, slot.next_start - now)
                    return

    def _busy_pids(self) -> list[int]:
        """The worker processes alive and busy on one bounded piece of work (a sample, loading a
        processor): the heartbeat vouches for them, since their own heartbeats wait on that work.
        A worker that is not busy heartbeats itself; one frozen outside such work falls silent."""
        return [s.process.pid for s in self.slots if s.process is not None and s.process.is_alive()
                and s.process.working_on().started_ns > 0]

    def _report(self, msg: P.Message) -> None:
        if self.control is not None and not send_nowait(self.control, msg) and self.registration is not None:
            log.warning("coordinator not reading; %s dropped; registering this host again", msg.TYPE)
            self.registration.forgotten()

    def _scale(self, procs: int, retire: list[int], reason: str) -> None:
        procs = max(self.min_procs, min(self.max_procs, procs))
        for slot in [s for s in self.slots if s.process is not None and s.process.pid in retire]:
            log.info("stopping worker process %d (%s)", slot.process.pid, reason)
            slot.process.terminate()
            slot.process.join(timeout=5)
            self.slots.remove(slot)
            if self.metrics is not None:
                self.metrics.process_gone(slot.process.pid)
        while len(self.slots) > procs:  # a count lowered without names: the last started go
            slot = self.slots.pop()
            if slot.process is not None:
                slot.process.terminate()
        if procs != self.target:
            log.info("worker processes: %d -> %d (%s)", self.target, procs, reason)
        self.target = procs

    def run(self) -> int:
        """Until stopped; returns the exit status (1: the coordinator refused this host)."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        self.prepare()
        return self.serve()

    def prepare(self) -> None:
        """The worker's modules and the fork server: in the process's main thread, before it has
        a zmq context or a second thread."""
        if self.metrics_port is not None:  # before the fork server: its children inherit the environment
            from .metrics import HostMetricsServer

            self.metrics = HostMetricsServer(self.metrics_port, self.metrics_host)
        # The worker's modules, imported once and frozen, then the fork server, forked before the
        # agent has a zmq context or a second thread: the agent, the server and every worker share
        # those pages. It takes a while (numpy, the readers): before the hello, so the agent is
        # never silent towards the coordinator while it starts.
        from . import preload  # noqa: F401

        self.forks.start()

    def serve(self) -> int:
        """Register with the coordinator and keep the worker processes running until stopped
        (prepare() first); the agent's zmq context lives and dies here, so this may run in a
        thread of a process that has other work (InProcessHost)."""
        if self.metrics is not None:
            self.metrics.serve()
            log.info("Prometheus metrics of this host's workers on http://%s:%d/metrics", self.metrics_host,
                     self.metrics_port)
        zctx = zmq.Context()
        control = self.control = make_socket(zctx, zmq.DEALER)
        if self.keys_dir:
            security.as_client(control, security.load(self.keys_dir, "worker"),
                               security.public_key(self.keys_dir, "coordinator"))
        self.registration = Registration(
            lambda: P.HostHello(version=P.PROTOCOL_VERSION, agent_id=self.agent_id, host=socket.gethostname(),
                                procs=self.target, min_procs=self.min_procs, max_procs=self.max_procs,
                                auto=int(self.auto)),
            lambda: P.HostHeartbeat(agent_id=self.agent_id, procs=self.target, pids=self._busy_pids()),
            heartbeat_s=HEARTBEAT_S)
        handshakes = security.HandshakeWatch(control)
        loop = self.loop = PeerLoop(control, self.registration, self.coordinator, who="worker host")
        loop.on(control, self._on_control)
        loop.on(handshakes.socket, lambda _: self._check_handshakes(handshakes))
        try:
            loop.run(lambda: not self.stopping, self._keep_alive)
        except KeyboardInterrupt:
            pass
        finally:
            handshakes.close()
            control.close(linger=0)
            zctx.term()
            self.shutdown()
            self.forks.stop()
            if self.metrics is not None:
                self.metrics.close()
        return 1 if self.refused else 0

    def _check_handshakes(self, handshakes: security.HandshakeWatch) -> None:
        reason = handshakes.refused()
        if handshakes.broke() and self.registration is not None:  # (LOST_MESSAGES) a worker's exit report, maybe
            # Info, not a warning: every stop of a coordinator closes it (a coordinator that is gone
            # for good is told by its silence), and the host registers again at no cost
            log.info("the connection to the coordinator closed; registering this host again")
            self.registration.forgotten()
        if reason is not None:
            log.error("the coordinator at %s refuses this host: %s; check --keys; stopping", self.coordinator, reason)
            self.refused = reason
            self.stopping = True

    def _on_control(self, control: zmq.Socket) -> None:
        try:
            msg = wire.receive(control.recv_multipart(), P.HOST_INBOX)
        except ProtocolError as e:
            log.warning("dropped message from coordinator: %s", e)
            return
        self._handle(msg)

    def _handle(self, msg: P.Message) -> None:
        if isinstance(msg, P.Scale):
            self.registration.welcomed(msg.heartbeat_s)
            self._scale(msg.procs, msg.retire, msg.reason)
        elif isinstance(msg, P.UnknownPeer):
            self.registration.forgotten()
        elif isinstance(msg, (P.Shutdown, P.JobFailed)):
            # The coordinator stops (a standby may take over, or it restarts) or its job failed:
            # keep the host up and say hello until a coordinator serves; stop with SIGTERM or Ctrl-C.
            if isinstance(msg, P.JobFailed):
                if msg.reason != self.job_failed:  # said once: every hello is answered so
                    self.job_failed = msg.reason
                    log.error("the job failed: %s; waiting for a coordinator to serve", msg.reason)
            else:
                log.info("coordinator stopping (%s); waiting for a coordinator to serve", msg.reason)
            self.loop.coordinator_stopping(time.monotonic())
        elif isinstance(msg, P.Reject):
            log.error("coordinator rejected this host: %s; stopping", msg.reason)
            self.refused = msg.reason
            self.stopping = True

    def stop(self) -> None:
        self.stopping = True

    def shutdown(self) -> None:
        for s in self.slots:
            if s.process is not None and s.process.is_alive():
                s.process.terminate()
        for s in self.slots:
            if s.process is not None:
                s.process.join(timeout=5)
                if s.process.is_alive():
                    s.process.kill()


def local_address(bind: str) -> str:
    """The address a process on this machine connects to for a coordinator bound at `bind`
    (a wildcard interface becomes loopback)."""
    for wildcard, loopback in (("tcp://*:", "tcp://127.0.0.1:"), ("tcp://0.0.0.0:", "tcp://127.0.0.1:"),
                               ("tcp://[::]:", "tcp://[::1]:")):
        if bind.startswith(wildcard):
            return loopback + bind[len(wildcard):]
    return bind


class InProcessHost:
    """This machine's worker host inside another process: the coordinator's, with `msd coordinator
    --worker-procs` (a job on one machine). The fork server is forked from that process at once,
    before it opens a file or a socket, so the coordinator, the server and the workers share one
    interpreter's imported modules (instead of the coordinator's and a host agent's); the agent's
    loop, which only starts, restarts and scales worker processes, runs in a thread of that
    process, so the agent's own interpreter (13 MB, tools/bench_e2e.py) is gone too. It speaks
    to the coordinator over the control socket like any other host.

    Create it in the main thread before anything else runs; start() once the coordinator's
    address and keys are known; close() stops the workers and the fork server."""

    def __init__(self, procs: int | None, max_procs: int | None = None, log_level: str = "INFO") -> None:
        self.agent = HostAgent("", procs, log_level, max_procs=max_procs)
        self.agent.prepare()
        self.thread: threading.Thread | None = None

    def start(self, coordinator: str, keys_dir: str | None = None) -> None:
        self.agent.coordinator, self.agent.keys_dir = coordinator, keys_dir
        self.thread = threading.Thread(target=self._serve, name="msd-host-agent", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.agent.serve()  # why it ended, if it did before close(), is in the log
        except Exception:  # noqa: BLE001 - the coordinator goes on; the host is gone, said in its log
            log.exception("the worker host in this process failed; its worker processes are stopped")

    def close(self) -> None:
        self.agent.stop()
        if self.thread is not None:
            self.thread.join(timeout=30)  # its loop sees `stopping` within a poll interval, then stops its workers
        else:
            self.agent.forks.stop()
