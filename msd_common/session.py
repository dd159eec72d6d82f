"""The loop every peer of the coordinator runs: say hello until welcomed, then heartbeat, say hello
again when the coordinator forgets us, and meanwhile serve the sockets. Written once here for
the worker process, the worker host agent and the trainer client's I/O thread.

A peer may be given several coordinator addresses (`tcp://a:5555,tcp://b:5555`: a primary and
its standbys). The coordinator answers every heartbeat (`alive`); a peer with several addresses
that hears nothing for LOST_AFTER_BEATS heartbeats, or gets no welcome for as long, moves on to
the next address and says hello there. With one address it stays (a coordinator restarted there
answers its next heartbeat with `unknown_peer`)."""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from typing import Callable

import zmq

from .protocol import Message
from .sockets import send_nowait

log = logging.getLogger("msd.session")

HELLO_RETRY_S = 2.0
# Why a peer says hello again by itself: its connection to the coordinator broke (ZeroMQ reconnects,
# but what was on its way is lost) or a message of its own was dropped (the queue to the coordinator
# full). Nothing else would tell either side: the coordinator would wait for an answer, or the peer
# for work, that never comes (found by msd.sim, issue 58). Registering again re-sends what was in flight.
LOST_MESSAGES = "messages to or from the coordinator were lost"
LOST_AFTER_BEATS = 3  # silence (in heartbeats) after which the coordinator is taken for gone
# A peer waiting for its first welcome says so after this long, then at doubling intervals up to
# WAITING_REPORT_MAX_S: ranks and workers often start before the coordinator, so waiting is right,
# but silence is not (which address, for how long, what may be wrong)
WAITING_REPORT_S = 3.0
WAITING_REPORT_MAX_S = 60.0
WAITING_HINT = ("is `msd coordinator` running there and reachable from this host? A job with security.curve "
                "needs this peer to have the job's keys")


@dataclass(frozen=True, slots=True)
class Forgotten:
    """The coordinator does not know this peer (a restarted coordinator, or one that took it for
    dead): say hello again. The same answer for a worker process and a trainer rank."""

    reason: str = ""


_ADDRESS = re.compile(r"(tcp://(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\],]+):(\d{1,5}|\*)|ipc://[^\s,]+|inproc://[^\s,]+)")


def check_address(address: str, bind: bool = False) -> str:
    """The address if ZeroMQ can use it (tcp://HOST:PORT, ipc://PATH, inproc://NAME; a port or host
    `*` only to bind), else ValueError saying what form it takes: ZeroMQ's own error would come
    later, from a thread, as a traceback, and the peer would wait for a coordinator it never
    reaches."""
    m = _ADDRESS.fullmatch(address)
    ok = m is not None
    if ok and address.startswith("tcp://"):
        host, port = m.group(2), m.group(3)
        ok = (port == "*" or 0 <= int(port) <= 65535) and (bind or (port != "*" and host != "*"))
    if not ok:
        hint = f" (tcp://{address})" if "://" not in address and ":" in address else ""
        raise ValueError(f"{address!r} is not an address msd can use{hint}: write tcp://HOST:PORT, e.g. "
                         f"tcp://127.0.0.1:5555{', or tcp://*:PORT for every interface' if bind else ''}, or "
                         "ipc://PATH")
    return address


def split_addresses(coordinator: str) -> list[str]:
    """`tcp://a:5555,tcp://b:5555` -> the addresses, in order (a primary first, then standbys);
    ValueError naming one that is not an address (check_address)."""
    out = [a.strip() for a in coordinator.split(",") if a.strip()]
    if not out:
        raise ValueError(f"no coordinator address in {coordinator!r}")
    return [check_address(a) for a in out]


class Registration:
    """When to send a hello or a heartbeat. `hello()` and `heartbeat()` build the messages."""

    def __init__(self, hello: Callable[[], Message], heartbeat: Callable[[], Message],
                 heartbeat_s: float = 1.0, retry_s: float = HELLO_RETRY_S) -> None:
        self.hello, self.heartbeat = hello, heartbeat
        self.heartbeat_s, self.retry_s = heartbeat_s, retry_s
        self.registered = False
        self._last_hello = self._last_beat = float("-inf")
        self.last_heard = float("-inf")  # the last message from the coordinator
        self.since = float("-inf")  # when we started talking to the current address

    def due(self, now: float) -> Message | None:
        """The message to send now, if one is due."""
        if not self.registered:
            if now - self._last_hello >= self.retry_s:
                self._last_hello = now
                return self.hello()
        elif now - self._last_beat >= self.heartbeat_s:
            self._last_beat = now
            return self.heartbeat()
        return None

    @property
    def last_beat(self) -> float:
        """When the last heartbeat (or a message that counts as one) went out."""
        return self._last_beat

    def heard(self, now: float) -> None:
        self.last_heard = now

    def spoke(self, now: float) -> None:
        """Another message to the coordinator went out (a rank's `consumed`): it shows we are
        alive as well as a heartbeat does, so the next heartbeat waits a full interval. A rank
        consuming a step a second then sends no heartbeats at all (at a thousand ranks, they and
        their answers were a third of the coordinator's messages)."""
        if self.registered:
            self._last_beat = max(self._last_beat, now)

    def silent(self, now: float) -> bool:
        """The coordinator at the current address said nothing for too long: registered and no
        answer to our heartbeats, or no answer to our hellos."""
        quiet = max(self.last_heard, self.since)
        limit = LOST_AFTER_BEATS * self.heartbeat_s if self.registered else max(self.retry_s, LOST_AFTER_BEATS *
                                                                                self.heartbeat_s)
        return now - quiet > limit

    def welcomed(self, heartbeat_s: float | None = None) -> None:
        """The coordinator accepted our hello (at the heartbeat interval it asks for)."""
        self.registered = True
        if heartbeat_s is not None:
            self.heartbeat_s = heartbeat_s

    def forgotten(self) -> None:
        """The coordinator does not know us (it restarted, or declared us dead): hello at once,
        unless a hello is already on its way (several messages of ours may each be answered
        `unknown_peer`; one hello for all of them)."""
        if self.registered:
            self._last_hello = float("-inf")
        self.registered = False

    def hello_now(self) -> None:
        self._last_hello = float("-inf")

    def waiting(self) -> None:
        """The coordinator is going away: hello again at the usual pace until one answers."""
        self.registered = False

    def stopping(self, now: float) -> None:
        """The coordinator at this (only) address stops: hello now, then at the usual pace until a
        coordinator answers (one restarted here); its silence counts from now."""
        self.waiting()
        self.hello_now()
        self.since = now


class PeerLoop:
    """Polls a control socket (and any others) and keeps the registration's rhythm. It connects
    the control socket to the coordinator (`addresses`: one, or a comma-separated list)."""

    def __init__(self, control: zmq.Socket, registration: Registration, addresses: str | list[str],
                 who: str | None = "peer") -> None:
        """who: how log lines name this peer (`rank 3`, `worker host`); None: it says nothing while
        it waits for its first welcome (a worker process, whose host agent says it already)."""
        self.control = control
        self.registration = registration
        self.addresses = split_addresses(addresses) if isinstance(addresses, str) else list(addresses)
        self.who = who
        self.current = 0
        self._started = time.monotonic()
        self._next_report = WAITING_REPORT_S  # seconds without a first welcome before the next report
        self._ever_welcomed = who is None
        self._poller = zmq.Poller()
        self._handlers: dict[zmq.Socket, Callable[[zmq.Socket], None]] = {}
        control.connect(self.addresses[0])
        registration.since = time.monotonic()

    @property
    def address(self) -> str:
        return self.addresses[self.current]

    def _move_on(self, now: float) -> None:
        """The coordinator at the current address is gone: talk to the next one."""
        old = self.address
        self.control.disconnect(old)
        self.current = (self.current + 1) % len(self.addresses)
        self.control.connect(self.address)
        log.warning("coordinator at %s silent for %.1fs; trying %s", old,
                    now - max(self.registration.last_heard, self.registration.since), self.address)
        self.registration.forgotten()
        self.registration.hello_now()
        self.registration.since = now

    def coordinator_stopping(self, now: float) -> None:
        """The coordinator said it stops (a graceful stop: it gave its lease up): with standbys, say
        hello to the next address at once rather than after heartbeats of silence; with one, say
        hello there until a coordinator answers (one restarted at that address)."""
        if len(self.addresses) > 1:
            self._move_on(now)
            return
        self.registration.stopping(now)

    def _report_waiting(self, now: float) -> None:
        """Until the first welcome: say, early and then at doubling intervals, what we wait for."""
        if self._ever_welcomed:
            return
        if self.registration.registered:
            self._ever_welcomed = True
            if self._next_report > WAITING_REPORT_S:  # we said we were waiting: say it is over
                log.info("%s: welcomed by the coordinator at %s after %.0fs", self.who, self.address,
                         now - self._started)
            return
        waited = now - self._started
        if waited >= self._next_report:
            self._next_report = min(self._next_report * 2, waited + WAITING_REPORT_MAX_S)
            log.warning("%s: waiting for the coordinator at %s: no welcome after %.0fs (%s)", self.who,
                        ", ".join(self.addresses), waited, WAITING_HINT)

    def _waiting_input(self) -> bool:
        """A message from the coordinator is waiting to be read."""
        return bool(self.control.get(zmq.EVENTS) & zmq.POLLIN)

    def on(self, sock: zmq.Socket, handler: Callable[[zmq.Socket], None]) -> None:
        """Call handler(sock) whenever sock has a message."""
        self._poller.register(sock, zmq.POLLIN)
        self._handlers[sock] = handler

    def on_writable(self, sock: zmq.Socket, handler: Callable[[zmq.Socket], None] | None) -> None:
        """Call handler(sock) whenever sock can take a message; None: stop polling it."""
        if handler is None:
            if sock in self._handlers:
                self._poller.unregister(sock)
                del self._handlers[sock]
            return
        self._poller.register(sock, zmq.POLLOUT)
        self._handlers[sock] = handler

    def run(self, running: Callable[[], bool], each: Callable[[float], None] | None = None) -> None:
        """Until running() is false. each(now), if given, runs once per turn, before the poll;
        a turn ends after a quarter of a heartbeat interval without messages."""
        while running():
            now = time.monotonic()
            # (a message waiting to be read is the coordinator speaking: silence counts only while
            # we listen, not while a long piece of work kept us from reading)
            if len(self.addresses) > 1 and self.registration.silent(now) and not self._waiting_input():
                self._move_on(now)
            msg = self.registration.due(now)
            if msg is not None and not send_nowait(self.control, msg):
                log.debug("coordinator not reachable yet; %s not sent", msg.TYPE)
            self._report_waiting(now)
            if each is not None:
                each(now)
            if not running():
                return
            for sock, _ in self._poller.poll(timeout=int(self.registration.heartbeat_s * 250)):
                started = time.monotonic()
                if sock is self.control:
                    self.registration.heard(started)
                self._handlers[sock](sock)
                done = time.monotonic()
                if done - started > self.registration.heartbeat_s:
                    # long work (a slow sample) kept us from listening: the coordinator's silence
                    # is counted from now, not from before it
                    self.registration.since = max(self.registration.since, done)
