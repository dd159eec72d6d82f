"""The relay process: one per trainer host (the paper's Data Constructor), `msd relay`.

Without a relay, every worker process holds a connection to every rank it delivers to (W x R)
and every rank speaks to the coordinator on its own. With one, a host's ranks connect to their
relay over ipc (`DataClient(..., relay=ENDPOINT)`), and the relay:

- takes the host's pieces from the workers on one data socket (one connection per worker
  process) and fans each out to the local ranks of its data-parallel rank: the coordinator asks
  for a DP rank's pieces once per relay, so a piece that several local ranks need (TP ranks, CP
  shards, a middle pipeline stage's metadata) crosses the network once;
- speaks for its ranks to the coordinator on one connection: one heartbeat for all of them (it
  answers theirs itself), their messages gathered into `relay_up` (a step's `consumed` of every
  local rank in one), and the coordinator's messages to them in one `relay_down` per burst.

It decides nothing and holds nothing its ranks and the coordinator cannot rebuild: killed and
started again, its ranks say hello through the new one with the step they need, and the
coordinator plans again from there (the stream is unchanged; pieces a rank has are dropped as
duplicates). Every message to a rank is checked by the rank; the relay reads only what it routes
by (a message's rank).

This module is its shell (sockets, signals); what it decides is `relay/core.py`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Any

import zmq

from msd_common import security
from msd_common.outbox import RankOutbox
from msd_common.relay_endpoints import default_endpoint
from msd_common.session import PeerLoop
from msd_common.sockets import make_socket, send_frames_nowait, send_nowait, waiting

from .core import HOLD_S, Action, MoveOn, RelayCore, ReleaseData, ToCoordinator, ToData, ToRank

log = logging.getLogger("msd.relay")


class Relay:
    """One relay process's sockets; `run()` serves until stopped. Its decisions: `self.core`."""

    def __init__(self, coordinator: str, *, host: str = "127.0.0.1", local: str | None = None,
                 bind_host: str | None = None, port: int = 0, keys_dir: str | None = None,
                 hold_s: float = HOLD_S) -> None:
        self.coordinator = coordinator
        self.host = host
        self.local = local or default_endpoint(coordinator)
        self.bind_host = bind_host or host
        self.port = port
        self.keys_dir = keys_dir
        self.hold_s = hold_s
        self.core: RelayCore | None = None
        self.data_address: str | None = None
        self._stopped = False

    @property
    def running(self) -> bool:
        return not self._stopped and (self.core is None or self.core.running)

    def run(self, ready=None) -> None:
        ctx = zmq.Context()
        auth = security.start_authenticator(ctx, self.keys_dir) if self.keys_dir else None
        up = make_socket(ctx, zmq.DEALER)
        local = make_socket(ctx, zmq.ROUTER)
        local.setsockopt(zmq.ROUTER_MANDATORY, 1)
        data_in = make_socket(ctx, zmq.PULL, hwm=10_000)
        if self.keys_dir:
            keys = security.load(self.keys_dir, "trainer")  # a relay speaks for trainer ranks: their key
            security.as_client(up, keys, security.public_key(self.keys_dir, "coordinator"))
            security.as_server(data_in, keys)
        path = self.local[len("ipc://"):] if self.local.startswith("ipc://") else None
        if path and os.path.exists(path):  # a relay killed before it could remove it; ours now
            os.unlink(path)
        local.bind(self.local)
        if self.port:
            data_in.bind(f"tcp://{self.bind_host}:{self.port}")
            port = self.port
        else:
            port = data_in.bind_to_random_port(f"tcp://{self.bind_host}")
        self.data_address = f"tcp://{self.host}:{port}"
        self.up, self.local_sock = up, local
        self.core = RelayCore(self.data_address, self.local, socket.gethostname(),
                              int.from_bytes(os.urandom(6), "little"), self.hold_s)
        self.loop = loop = PeerLoop(up, self.core.registration, self.coordinator, who="relay")
        self.outbox = RankOutbox(lambda address: self._push(ctx, address), self._writable)
        loop.on(up, self._on_up)
        loop.on(local, self._on_local)
        loop.on(data_in, self._on_data)
        handshakes = security.HandshakeWatch(up)
        loop.on(handshakes.socket, lambda _: self._on_handshake(handshakes))
        log.info("relay: ranks at %s, workers at %s, coordinator %s", self.local, self.data_address,
                 self.coordinator)
        if ready is not None:
            ready(self)
        try:
            loop.run(lambda: self.running, self._turn)
        finally:
            handshakes.close()
            self.outbox.close()
            for s in (up, local, data_in):
                s.close(linger=500)
            if auth is not None:
                auth.stop()
            ctx.term()
            if path and os.path.exists(path):  # the ranks' endpoint is ours to remove
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def stop(self, *_: Any) -> None:
        self._stopped = True

    def _do(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, ToData):
                self.outbox.send(a.address, a.frames, False)
            elif isinstance(a, ToRank):
                try:
                    send_frames_nowait(self.local_sock, [a.identity, *a.frames], copy=False)
                except zmq.ZMQError:  # gone, or not reading: it says hello again when it is back
                    pass
            elif isinstance(a, ToCoordinator):
                if not send_nowait(self.up, a.message):
                    log.warning("relay: coordinator not reading; %s dropped", a.message.TYPE)
                    self.core.connection_lost(f"{a.message.TYPE} dropped")
            elif isinstance(a, ReleaseData):
                self.outbox.release(a.address)
            elif isinstance(a, MoveOn):
                self.loop.coordinator_stopping(time.monotonic())

    def _on_handshake(self, handshakes: security.HandshakeWatch) -> None:
        reason = handshakes.refused()
        if handshakes.broke():
            self.core.connection_lost(f"the connection to {self.loop.address} broke")
        if reason is not None:  # the coordinator will never talk to this relay: its ranks are told why
            why = (f"the coordinator at {self.loop.address} refused the relay's connection ({reason}); the job sets "
                   f"security.curve? {'check' if self.keys_dir else 'give the relay'} --keys, the job's key directory")
            log.error("relay: %s", why)
            self._do(self.core.refuse(why))

    def _push(self, ctx: zmq.Context, address: str) -> zmq.Socket:
        sock = make_socket(ctx, zmq.PUSH, hwm=10_000)
        sock.connect(address)
        return sock

    def _writable(self, sock: zmq.Socket, on: bool) -> None:
        self.loop.on_writable(sock, self.outbox.flush if on else None)

    def _turn(self, now: float) -> None:
        self.core.queued = self.outbox.backlog()
        self._do(self.core.turn(now))

    def _on_local(self, sock: zmq.Socket) -> None:
        for frames in waiting(sock, copy=True):
            self._do(self.core.on_local(frames[0], frames[1:], time.monotonic()))

    def _on_up(self, sock: zmq.Socket) -> None:
        self._do(self.core.on_up(sock.recv_multipart(copy=False), time.monotonic()))

    def _on_data(self, sock: zmq.Socket) -> None:
        for frames in waiting(sock):
            self._do(self.core.on_data(frames, frames[0].buffer))


def serve(coordinator: str, **kwargs: Any) -> None:
    """Run a relay until SIGTERM or SIGINT (`msd relay`)."""
    relay = Relay(coordinator, **kwargs)
    signal.signal(signal.SIGTERM, relay.stop)
    signal.signal(signal.SIGINT, relay.stop)
    relay.run()
