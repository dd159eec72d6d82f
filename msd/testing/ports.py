"""Free TCP ports on loopback for tests and benchmarks that start several listeners.

A port found by binding port 0 lies in the kernel's ephemeral range: between finding it and the
listener binding it, any outgoing connection on the machine (a worker's, a zmq socket's, the
torch store's) can be given the same port, and the listener then fails with EADDRINUSE (CI saw
torch's TCPStore fail so). Ports below the ephemeral range are never handed out to outgoing
connections, so one found free there stays free until someone binds it on purpose.
"""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE = "/proc/sys/net/ipv4/ip_local_port_range"
_SPAN = 8000  # how far below the ephemeral range to look
_taken: set[int] = set()  # handed out by this process: two calls never give the same port


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` that nobody listens on, below the ephemeral range."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(500):
        port = rng.randrange(max(1024, low - _SPAN), low)
        if port in _taken:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError(f"no free port on {host} in [{max(1024, low - _SPAN)}, {low})")


def free_address(host: str = "127.0.0.1") -> str:
    """A `tcp://host:port` address nobody listens on yet."""
    return f"tcp://{host}:{free_port(host)}"
