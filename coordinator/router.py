"""The coordinator's control socket, apart from the coordinator proper: the counting phase of a
cold start (counting.py) binds and serves it before the coordinator's modules are imported, then
hands it to the Coordinator (app.py)."""

from __future__ import annotations

from typing import Any

import zmq

from msd_common import security
from msd_common.sockets import make_socket

from msd_common.spec import JobConfig


class Router:
    """The coordinator's control socket: one ROUTER that workers, host agents, trainers and tools
    connect to (with CURVE and its authenticator on a job that sets security.curve). A plain
    socket, not zmq.asyncio's: at a thousand ranks its futures cost more than the messages;
    asyncio only watches the socket's descriptor (Coordinator._receive_loop)."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, auth: Any, address: str) -> None:
        self.ctx, self.sock, self.auth, self.address = ctx, sock, auth, address

    @classmethod
    def open(cls, job: JobConfig, bind: str) -> "Router":
        ctx = zmq.Context()
        sock = make_socket(ctx, zmq.ROUTER, hwm=100_000)
        auth = None
        try:
            if job.curve_keys:  # only workers and trainers holding an authorised key get through
                auth = security.start_authenticator(ctx, job.curve_keys)
                security.as_server(sock, security.load(job.curve_keys, "coordinator"))
            sock.bind(bind)
        except BaseException:
            cls(ctx, sock, auth, bind).close()
            raise
        return cls(ctx, sock, auth, sock.getsockopt(zmq.LAST_ENDPOINT).decode())

    def close(self) -> None:
        self.sock.close(linger=500)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
