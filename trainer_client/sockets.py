"""The one place sockets are made, so every socket gets explicit LINGER, finite high-water marks
and a maximum message size (a hostile peer cannot make us buffer without bound)."""

from __future__ import annotations

import zmq

from . import protocol, wire

DEFAULT_HWM = 1000
LINGER_MS = 1000


def make_socket(ctx: zmq.Context, kind: int, *, hwm: int = DEFAULT_HWM, linger_ms: int = LINGER_MS) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    if kind == zmq.ROUTER:
        # Without MANDATORY a ROUTER silently drops messages to unknown peers; with it we get
        # EHOSTUNREACH and can log it. HANDOVER lets a reconnecting peer take its identity back.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
    return sock


def bind_free_port(sock: zmq.Socket, host: str) -> str:
    """Bind to an OS-chosen port on `host` and return the address peers should connect to."""
    port = sock.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{port}"


def send_nowait(sock: zmq.Socket, header: dict, *arrays) -> bool:
    """Send one message without blocking: a peer that is not reading (or not there yet) must never
    stall the sender. False when it could not go out now (high-water mark reached)."""
    try:
        sock.send_multipart(wire.encode(header, *arrays), flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True
