"""The one place sockets are made, so every socket gets explicit LINGER, finite high-water marks
and a maximum message size (a hostile peer cannot make us buffer without bound)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

import zmq

from . import protocol, wire

if TYPE_CHECKING:
    from .protocol import Message

DEFAULT_HWM = 1000
LINGER_MS = 1000
# A connect to an address nobody listens on yet is tried again after 10 ms, then 20, 40, ... up
# to libzmq's default of 100 ms: workers and host agents started with their coordinator (one
# command each) connect before it binds, and waited out a whole 100 ms before their first hello
# got through (0.1 s of a 1.3 s cold start, both cores idle).
RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 100


def make_socket(ctx: zmq.Context, kind: int, *, hwm: int = DEFAULT_HWM, linger_ms: int = LINGER_MS) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, linger_ms)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_FRAME_BYTES)
    sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
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


# Plain ints: pyzmq's send_multipart ORs enum flags per frame, and enum arithmetic is ~1 us a
# time (a tenth of a worker's CPU per delivery, 8 messages of 4-5 frames).
NOWAIT = int(zmq.NOBLOCK)
_MORE_NOWAIT = int(zmq.SNDMORE | zmq.NOBLOCK)
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


def has_message(sock: zmq.Socket) -> bool:
    """Whether a message waits on the socket now (ZMQ_EVENTS): cheaper than a receive that raises
    zmq.Again, and true even where a send took the edge of its descriptor."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def waiting(sock: zmq.Socket, most: int = 1000, copy: bool = False) -> Iterator[list]:
    """The messages waiting on a socket now, at most `most` (a turn of a loop that serves others too):
    many small messages may queue up behind one poll."""
    for _ in range(most):
        if not has_message(sock):
            return
        try:
            yield sock.recv_multipart(NOWAIT, copy=copy)
        except zmq.Again:
            return


def send_frames_nowait(sock: zmq.Socket, frames: list, copy: bool = True) -> None:
    """One multipart message without blocking; raises zmq.Again when the socket does not take it
    (a message is taken whole or not at all: libzmq checks the high-water mark at its first frame)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        sock.send(frame, _MORE_NOWAIT if i < last else NOWAIT, copy=copy)


def send_nowait(sock: zmq.Socket, message: "Message | dict", *arrays) -> bool:
    """Send one message without blocking: a peer that is not reading (or not there yet) must never
    stall the sender. False when it could not go out now (high-water mark reached)."""
    try:
        send_frames_nowait(sock, wire.encode(message, *arrays))
    except zmq.Again:
        return False
    return True


def raise_fd_limit(role: str, want: int = 65536) -> int:
    """Raise this process's open-file limit towards `want` (every peer connection is a file
    descriptor: a worker pushing to 1,024 ranks holds over 1,024), as far as the hard limit allows;
    returns the limit now. A hard limit below what a large job needs is logged, naming it."""
    import logging
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft < 4096:
        logging.getLogger("msd").warning(
            "%s: the open-file limit (RLIMIT_NOFILE) is %d and cannot be raised (hard limit %s): each rank this "
            "process talks to takes a file descriptor, so a job of more than about %d ranks will fail here; raise "
            "it (ulimit -n, LimitNOFILE= in systemd, or /etc/security/limits.conf)", role, soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard, max(0, soft - 64))
    return soft
