"""Pieces on their way to trainer ranks (from a worker, or from a relay to its local ranks): one
PUSH socket per data address, sent without ever blocking, with a per-address backlog for what a
socket will not take now.

Why not a blocking send: a rank that stops reading (its process frozen, its I/O thread starved)
would stop the worker's loop, and with it the worker's heartbeats, so the coordinator would
declare a healthy worker dead and prepare its records again. With a backlog the loop goes on:
the backlog is flushed as the socket becomes writable (the loop polls it for POLLOUT). Its size
is bounded by the coordinator's look-ahead (no step is planned more than `lookahead_steps`
beyond the slowest rank's consumed one), not by a timeout; a rank that has truly gone is
released by the coordinator (`release_rank`, sent when its heartbeats stop), which drops its
backlog and socket.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

import zmq

from .sockets import send_frames_nowait

log = logging.getLogger("msd.worker")


class RankOutbox:
    def __init__(self, make: Callable[[str], zmq.Socket], writable: Callable[[zmq.Socket, bool], None]) -> None:
        """make(address): a connected PUSH socket; writable(sock, on): poll sock for POLLOUT or stop."""
        self._make, self._writable = make, writable
        self.sockets: dict[str, zmq.Socket] = {}
        self._backlog: dict[str, collections.deque[tuple[list, bool]]] = {}
        self._address_of: dict[zmq.Socket, str] = {}
        self.waits = 0  # sends that found a rank's socket full (reported in heartbeats)

    def send(self, address: str, frames: list, copy: bool) -> None:
        """Send now if the rank's socket takes it and nothing is waiting before it; else queue it."""
        queue = self._backlog.get(address)
        if queue:
            queue.append((frames, copy))
            return
        sock = self._socket(address)
        try:
            send_frames_nowait(sock, frames, copy)
        except zmq.Again:
            self.waits += 1
            self._backlog[address] = collections.deque([(frames, copy)])
            self._writable(sock, True)

    def flush(self, sock: zmq.Socket) -> None:
        """The socket became writable: send what waits for it, in order, while it takes it."""
        address = self._address_of.get(sock)
        queue = self._backlog.get(address) if address is not None else None
        while queue:
            frames, copy = queue[0]
            try:
                send_frames_nowait(sock, frames, copy)
            except zmq.Again:
                return
            queue.popleft()
        self._backlog.pop(address, None)
        self._writable(sock, False)

    def release(self, address: str) -> int:
        """The rank at this address is gone: drop what waits for it and its socket; returns the
        number of messages dropped."""
        queue = self._backlog.pop(address, None)
        sock = self.sockets.pop(address, None)
        if sock is not None:
            if queue:
                self._writable(sock, False)
            del self._address_of[sock]
            sock.close(linger=0)
        return len(queue or ())

    def backlog(self) -> int:
        """Messages waiting, over all ranks."""
        return sum(len(q) for q in self._backlog.values())

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close(linger=1000)
        self.sockets.clear()

    def _socket(self, address: str) -> zmq.Socket:
        sock = self.sockets.get(address)
        if sock is None:
            sock = self.sockets[address] = self._make(address)
            self._address_of[sock] = address
        return sock
