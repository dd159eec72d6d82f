"""A failed job stays answerable: after a fatal stop the coordinator keeps its address for
`runtime.failed_linger_s` (or until SIGTERM) and answers every message with `job_failed` and the
reason, so ranks, relays and workers that arrive late learn why, within one round trip, instead of
waiting out a timeout on an address that answers nothing. `msd status` gets the last status,
failure included; `/readyz` says failed. Nothing here decides anything about the plan.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import zmq

from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from msd_common.sockets import NOWAIT, has_message

log = logging.getLogger("msd.coordinator")

ANSWER_EVERY_S = 1.0  # one job_failed per peer this often at most (its hellos come every 2 s)


async def linger(sock: zmq.Socket, reason: str, linger_s: float, status: Callable[[], dict[str, Any]],
                 stop: asyncio.Event, beat: Callable[[], None] = lambda: None) -> None:
    """Answer on `sock` until linger_s has passed or `stop` is set; beat() at least every second
    (the process is alive: /healthz stays good while /readyz says failed)."""
    if linger_s <= 0:
        return
    log.error("the job failed (%s); answering every peer with the reason for %.0fs (runtime.failed_linger_s), or "
              "until stopped", reason, linger_s)
    loop = asyncio.get_running_loop()
    readable = asyncio.Event()
    loop.add_reader(sock.FD, readable.set)
    answered: dict[bytes, float] = {}
    deadline = time.monotonic() + linger_s
    failed = P.JobFailed(reason=reason)
    try:
        while not stop.is_set() and time.monotonic() < deadline:
            beat()
            if not has_message(sock):
                readable.clear()
                waits = [asyncio.create_task(readable.wait()), asyncio.create_task(stop.wait())]
                _, pending = await asyncio.wait(waits, timeout=min(1.0, max(0.0, deadline - time.monotonic())),
                                                return_when=asyncio.FIRST_COMPLETED)
                for t in pending:
                    t.cancel()
                continue
            try:
                frames = sock.recv_multipart(NOWAIT)
            except zmq.Again:
                continue
            identity = frames[0]
            try:
                header, _ = wire.decode(frames[1:], P.COORDINATOR_INBOX)
            except ProtocolError as e:
                log.warning("dropped message from peer %s: %s", identity.hex(), e)
                continue
            if header["type"] == P.StatusRequest.TYPE:
                answer = P.StatusReply(status=status())
            else:
                now = time.monotonic()
                if now - answered.get(identity, float("-inf")) < ANSWER_EVERY_S:
                    continue
                answered[identity] = now
                answer = failed
            try:
                sock.send_multipart([identity, *wire.encode(answer)], NOWAIT)
            except zmq.ZMQError:  # a peer gone meanwhile (ROUTER_MANDATORY), or its queue full
                pass
    finally:
        loop.remove_reader(sock.FD)
