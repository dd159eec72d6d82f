"""One worker process: a plain synchronous loop around a poller (trainer_client.session.PeerLoop).

It owns the sockets and nothing else: the control DEALER to the coordinator and one PUSH per
trainer data address. Messages from the coordinator go to `WorkerCore.handle` (worker/core.py),
and the loop carries out the actions it returns. The process may be killed at any moment; it
exits when its host agent dies.
"""

from __future__ import annotations

import logging
import os
import socket
import time

import zmq

from trainer_client import memory, security
from trainer_client import protocol as P
from trainer_client import wire
from trainer_client.errors import ProtocolError
from trainer_client.logs import setup_logging
from trainer_client.session import PeerLoop, Registration
from trainer_client.sockets import make_socket, send_nowait

from .core import Action, Forgotten, Quit, Registered, ToCoordinator, ToRank, WorkerCore

log = logging.getLogger("msd.worker")

SEND_TIMEOUT_MS = 30_000
# Below this, copying a frame is cheaper than zero-copy bookkeeping (pyzmq tracks zero-copy
# frames through a garbage-collector thread).
ZERO_COPY_BYTES = 1 << 20


class Worker:
    def __init__(self, coordinator: str, parent_pid: int | None = None, keys_dir: str | None = None,
                 agent_id: int = 0) -> None:
        self.parent_pid = parent_pid
        self.core = WorkerCore()
        self.ctx = zmq.Context()
        self.control = make_socket(self.ctx, zmq.DEALER)
        # CURVE: this host's worker key pair; the coordinator's and trainers' public keys
        self.keys = security.load(keys_dir, "worker") if keys_dir else None
        self.trainer_key = security.public_key(keys_dir, "trainer") if keys_dir else None
        if self.keys:
            security.as_client(self.control, self.keys, security.public_key(keys_dir, "coordinator"))
        self.control.connect(coordinator)
        self.data: dict[str, zmq.Socket] = {}  # trainer data address -> PUSH socket
        incarnation = int.from_bytes(os.urandom(6), "little")
        self.registration = Registration(
            lambda: P.make(P.WORKER_HELLO, version=P.PROTOCOL_VERSION, host=socket.gethostname(), pid=os.getpid(),
                           incarnation=incarnation, agent=agent_id),
            lambda: self.core.heartbeat(self.busy_s))
        self.running = True
        self.busy_s = 0.0  # total time spent on prepare and deliver work (reported in heartbeats)

    def close(self) -> None:
        for s in self.data.values():
            s.close(linger=1000)
        self.control.close(linger=0)
        self.ctx.term()

    def run(self) -> None:
        handshakes = security.HandshakeWatch(self.control)
        loop = PeerLoop(self.control, self.registration)
        loop.on(self.control, self._on_control)
        loop.on(handshakes.socket, lambda _: self._check_handshakes(handshakes))
        try:
            loop.run(lambda: self.running, self._check_parent)
        finally:
            handshakes.close()

    def _check_handshakes(self, handshakes: security.HandshakeWatch) -> None:
        reason = handshakes.refused()
        if reason is not None:
            log.error("the coordinator refuses this worker: %s; check --keys; stopping", reason)
            self.running = False

    def _check_parent(self, now: float) -> None:
        if self.parent_pid is not None and not _alive(self.parent_pid):
            log.info("host agent is gone; exiting")
            self.running = False

    def _on_control(self, sock: zmq.Socket) -> None:
        try:
            header, arrays = wire.decode(sock.recv_multipart(copy=False), P.WORKER_INBOX)
        except ProtocolError as e:
            log.warning("dropped message from coordinator: %s", e)
            return
        started = time.perf_counter()
        actions = self.core.handle(header, arrays)
        for action in actions:
            self._do(action, started)
        self.busy_s += time.perf_counter() - started

    def _do(self, action: Action, started: float) -> None:
        if isinstance(action, ToCoordinator):
            header = action.header
            if header["type"] == "prepared":  # the core keeps no clock: the task's seconds are the loop's
                header = {**header, "busy_s": time.perf_counter() - started}
            if not send_nowait(self.control, header, *action.arrays):
                log.warning("coordinator not reading; %s dropped", header["type"])
        elif isinstance(action, ToRank):
            frames = wire.encode(action.header, *action.arrays)
            try:
                self._data_socket(action.address).send_multipart(frames, copy=action.arrays[1].nbytes < ZERO_COPY_BYTES)
            except zmq.Again:
                log.error("step %d: rank %d at %s did not take its pieces within %ds", action.header["step"],
                          action.header["rank"], action.address, SEND_TIMEOUT_MS // 1000)
        elif isinstance(action, Registered):
            self.busy_s = 0.0  # counted from registration: the coordinator compares heartbeats over time
            self.registration.welcomed(action.heartbeat_s)
        elif isinstance(action, Forgotten):
            self.registration.forgotten()
        elif isinstance(action, Quit):
            self.running = False

    def _data_socket(self, address: str) -> zmq.Socket:
        sock = self.data.get(address)
        if sock is None:
            sock = make_socket(self.ctx, zmq.PUSH)
            if self.keys:
                security.as_client(sock, self.keys, self.trainer_key)
            # Blocking send is our flow control (the coordinator bounds how far ahead anyone is);
            # the timeout keeps a vanished trainer from wedging the worker forever.
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            sock.connect(address)
            self.data[address] = sock
        return sock


def _alive(pid: int) -> bool:
    """Whether the host agent still runs (it is not our parent: a fork server is)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run_worker(coordinator: str, parent_pid: int | None = None, log_level: str = "INFO",
               log_path: str | None = None, keys_dir: str | None = None, agent_id: int = 0) -> None:
    """Entry point of one worker process (spawned by the host agent)."""
    setup_logging(log_level, "worker", log_path)
    memory.keep_freed_memory()
    worker = Worker(coordinator, parent_pid, keys_dir, agent_id)
    try:
        worker.run()
    except KeyboardInterrupt:
        pass
    finally:
        worker.close()
