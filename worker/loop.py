"""One worker process: a plain synchronous loop around a poller (msd_common.session.PeerLoop).

It owns the sockets and nothing else: the control DEALER to the coordinator and one PUSH per
trainer data address (`outbox.py`: sends that never block, a backlog per rank). Messages from the coordinator go to
`WorkerCore.handle` (worker/core.py),
and the loop carries out the actions it returns. The process may be killed at any moment; it
exits when its host agent dies.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any

import zmq

from msd_common import memory, security
from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from msd_common.logs import setup_logging
from msd_common.session import PeerLoop, Registration
from msd_common.sockets import make_socket, raise_fd_limit, send_nowait

from msd_common.formats import storage
from .core import (Action, CoordinatorStopping, Forgotten, Quit, Registered, ReleaseRank, ToCoordinator, ToRank,
                   WorkerCore)
from .metrics import prepared_tokens, worker_metrics
from msd_common.outbox import RankOutbox

log = logging.getLogger("msd.worker")
MAX_SOCKETS = 65536

# Below this, copying a frame is cheaper than zero-copy bookkeeping (pyzmq tracks zero-copy
# frames through a garbage-collector thread).
ZERO_COPY_BYTES = 1 << 20
# Freed heap pages go back to the OS this often (msd_common.memory.return_freed_memory): a
# trim of a worker's heap takes well under a millisecond; the pages it frees fault in again later
TRIM_EVERY_S = 2.0
PARENT_CHECK_S = 0.5  # inside long work (keep_alive), whether the host agent is still there


class Worker:
    def __init__(self, coordinator: str, parent_pid: int | None = None, keys_dir: str | None = None,
                 agent_id: int = 0, current_task: Any = None) -> None:
        """current_task: this worker's cell of the table it shares with its host agent
        (worker.forks.WorkCell): the prepare task and the sample being worked on, and since when,
        so that the agent can stop a sample past its source's max_sample_s and say which task and
        record a crash happened in."""
        self.parent_pid = parent_pid
        self._adopted = False  # the agent is our parent (once our intermediate process has exited)
        self.current_task = current_task
        self.core = WorkerCore()
        self.ctx = zmq.Context()
        # one PUSH socket per rank: libzmq's default of 1,023 sockets per context stopped a worker
        # short of a thousand ranks (the open-file limit is raised at start, raise_fd_limit)
        self.ctx.set(zmq.MAX_SOCKETS, MAX_SOCKETS)
        self.control = make_socket(self.ctx, zmq.DEALER)
        # CURVE: this host's worker key pair; the coordinator's and trainers' public keys
        self.keys = security.load(keys_dir, "worker") if keys_dir else None
        self.trainer_key = security.public_key(keys_dir, "trainer") if keys_dir else None
        if self.keys:
            security.as_client(self.control, self.keys, security.public_key(keys_dir, "coordinator"))
        self.coordinator = coordinator  # one address, or a primary and its standbys (comma-separated)
        self.loop: PeerLoop | None = None
        self.outbox = RankOutbox(self._data_socket, self._poll_writable)  # pieces to ranks, never blocking
        incarnation = int.from_bytes(os.urandom(6), "little")
        self.registration = Registration(
            lambda: P.WorkerHello(version=P.PROTOCOL_VERSION, host=socket.gethostname(), pid=os.getpid(),
                                  incarnation=incarnation, agent=agent_id),
            lambda: self.core.heartbeat(self.busy_s, self.outbox.backlog(), self.outbox.waits))
        self.running = True
        self.busy_s = 0.0  # total time spent on prepare and deliver work (reported in heartbeats)
        self.metrics = worker_metrics()  # Prometheus (msd worker --metrics-port), or None
        self._sampled = 0.0
        self._trimmed = time.monotonic()
        self._kept_alive = float("-inf")
        self._parent_checked = float("-inf")
        self.core.keep_alive = self._keep_alive
        if current_task is not None:
            self.core.on_sample = self._on_sample
        storage.keep_alive = self._keep_alive  # a read waiting out a throttled store

    def close(self) -> None:
        self.outbox.close()
        self.control.close(linger=0)
        self.ctx.term()

    def run(self) -> None:
        handshakes = security.HandshakeWatch(self.control)
        loop = self.loop = PeerLoop(self.control, self.registration, self.coordinator, who=None)
        loop.on(self.control, self._on_control)
        loop.on(handshakes.socket, lambda _: self._check_handshakes(handshakes))
        try:
            loop.run(lambda: self.running, self._each_turn)
        finally:
            handshakes.close()

    def _check_handshakes(self, handshakes: security.HandshakeWatch) -> None:
        reason = handshakes.refused()
        if handshakes.broke():
            for action in self.core.connection_lost("the connection to the coordinator broke"):
                self._do(action, time.perf_counter())
        if reason is not None:
            log.error("the coordinator refuses this worker: %s; check --keys; stopping", reason)
            self.running = False

    def _each_turn(self, now: float) -> None:
        self._check_parent(now)
        if now - self._trimmed >= TRIM_EVERY_S:
            self._trimmed = now
            memory.return_freed_memory()
        if self.metrics is not None and now - self._sampled >= 1.0:
            self._sampled = now
            self.metrics.sample(now, self.busy_s, self.outbox.waits)

    def _check_parent(self, now: float) -> None:
        """Exit once the host agent is gone: our parent, from shortly after the fork on, so another
        parent means it died (even while its exit status is not collected yet, when its pid still
        answers a signal)."""
        if self.parent_pid is None:
            return
        parent = os.getppid()
        self._adopted = self._adopted or parent == self.parent_pid
        if (self._adopted and parent != self.parent_pid) or not _alive(self.parent_pid):
            log.info("host agent is gone; exiting")
            self.running = False

    def _on_control(self, sock: zmq.Socket) -> None:
        try:
            msg = wire.receive(sock.recv_multipart(copy=False), P.WORKER_INBOX)
        except ProtocolError as e:
            log.warning("dropped message from coordinator: %s", e)
            return
        started = time.perf_counter()
        marked = self.current_task is not None and isinstance(msg, P.Prepare)
        if marked:
            self.current_task.task = msg.task_id
        actions = self.core.handle(msg)
        if marked:
            self.current_task.task = -1
        if self.metrics is not None and isinstance(msg, P.Prepare) and 0 <= msg.source < len(self.core.specs):
            self.metrics.prepared(self.core.specs[msg.source].name, len(msg.records), prepared_tokens(actions),
                                  time.perf_counter() - started)
        for action in actions:
            self._do(action, started)
        self.busy_s += time.perf_counter() - started

    def _do(self, action: Action, started: float) -> None:
        if isinstance(action, ToCoordinator):
            msg = action.message
            if isinstance(msg, P.Prepared):  # the core keeps no clock: the task's seconds are the loop's
                msg = dataclasses.replace(msg, busy_s=time.perf_counter() - started)
            if not send_nowait(self.control, msg):
                log.warning("coordinator not reading; %s dropped", msg.TYPE)
                for lost in self.core.connection_lost(f"{msg.TYPE} dropped"):
                    self._do(lost, started)
        elif isinstance(action, ToRank):
            pieces = action.message
            if self.metrics is not None:
                self.metrics.pieces.inc(len(pieces.items))
            frames = wire.encode(pieces)
            # large messages go without a copy into zmq (a processor's pixel values are megabytes)
            size = sum(a.nbytes for a in pieces.frames()) + sum(a.nbytes for a in pieces.tail)
            self.outbox.send(action.address, frames, copy=size < ZERO_COPY_BYTES)
        elif isinstance(action, ReleaseRank):
            dropped = self.outbox.release(action.address)
            if dropped:
                log.warning("rank at %s is gone: %d message(s) for it dropped", action.address, dropped)
        elif isinstance(action, Registered):
            self.busy_s = 0.0  # counted from registration: the coordinator compares heartbeats over time
            self.registration.welcomed(action.heartbeat_s)
        elif isinstance(action, Forgotten):
            self.registration.forgotten()
        elif isinstance(action, Quit):
            self.running = False
        elif isinstance(action, CoordinatorStopping) and self.loop is not None:
            self.loop.coordinator_stopping(time.monotonic())

    def _keep_alive(self) -> None:
        """A heartbeat now, if one is due, from inside long work of the core (same thread, same
        socket): a registered worker, or one working through its welcome (opening its sources),
        is not to be taken for dead while it works. And the end of that work if the host agent is
        gone: indexing a corpus at a welcome can take hours, and the worker would go on alone."""
        now = time.monotonic()
        if now - self._parent_checked >= PARENT_CHECK_S:  # called per record: two syscalls, not every time
            self._parent_checked = now
            self._check_parent(now)
            if not self.running:
                raise SystemExit(0)
        interval = self.registration.heartbeat_s
        if self.core.worker_id is None or now - max(self._kept_alive, self.registration.last_beat) < interval:
            return
        self._kept_alive = now
        send_nowait(self.control, self.registration.heartbeat())
        self.registration.spoke(now)

    def _on_sample(self, source: int, record: int, limit_s: float) -> None:
        """The core starts a bounded piece of work (limit_s > 0: a sample, or loading a processor) or
        is done with it (0): the agent's clock of it, and what it vouches for meanwhile."""
        cell = self.current_task
        if limit_s <= 0:
            cell.started_ns = 0
            cell.source = cell.record = -1
            return
        cell.source, cell.record, cell.limit_ns = source, record, int(limit_s * 1e9)
        cell.started_ns = time.monotonic_ns()  # last: the agent reads a sample's fields once this is set

    def _data_socket(self, address: str) -> zmq.Socket:
        sock = make_socket(self.ctx, zmq.PUSH)
        if self.keys:
            security.as_client(sock, self.keys, self.trainer_key)
        sock.connect(address)
        return sock

    def _poll_writable(self, sock: zmq.Socket, on: bool) -> None:
        if self.loop is not None:
            self.loop.on_writable(sock, self.outbox.flush if on else None)


def _alive(pid: int) -> bool:
    """Whether the host agent still runs."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_worker(coordinator: str, parent_pid: int | None = None, log_level: str = "INFO",
               log_path: str | None = None, keys_dir: str | None = None, agent_id: int = 0,
               current_task: Any = None) -> None:
    """Entry point of one worker process (spawned by the host agent)."""
    setup_logging(log_level, "worker", log_path, replace=True)  # forked: the agent's handlers are inherited
    memory.keep_freed_memory()
    raise_fd_limit("worker")
    worker = Worker(coordinator, parent_pid, keys_dir, agent_id, current_task)
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
