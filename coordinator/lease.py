"""The lease on a state dir: which coordinator serves the job, so that two never serve at once.

`STATE/lease` holds one fixed-size JSON record: the holder, its fencing token, the address it
serves on, and a beat counter the holder advances every heartbeat. The record is rewritten in
place (the same bytes of the same file, fsynced), so renewing needs no free space: a full disk
does not cost a healthy coordinator its lease.

Nobody compares clocks (the hosts sharing the state dir may disagree on the time): a standby
watches the record with its own monotonic clock, and takes the lease over when the beat has not
moved for `3 x heartbeat_s`, writing the next token. A holder reads the record before each renewal
and before each journal write (`check`): a token that is not its own means another coordinator
took over, and it stops at once. A holder that cannot renew for `2 x heartbeat_s` stops too, before
any standby may take over.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Callable

import orjson

from msd_common.errors import MsdError

log = logging.getLogger("msd.coordinator.lease")

LEASE = "lease"
RECORD_BYTES = 512
STALE_BEATS = 3  # a lease whose beat did not move for this many heartbeats is free
SELF_FENCE_BEATS = 2  # a holder that could not renew for this many heartbeats stops serving


RELEASED = ""  # the holder of a lease given up on a clean stop: free at once


class LeaseLost(MsdError):
    """Another coordinator holds the lease on this state dir now."""


class LeaseHeld(MsdError):
    """A live coordinator holds the lease: this one (not a standby) must not serve."""


@dataclass(frozen=True)
class LeaseRecord:
    holder: str
    token: int
    address: str
    beat: int

    def encode(self) -> bytes:
        raw = orjson.dumps({"holder": self.holder, "token": self.token, "address": self.address, "beat": self.beat})
        if len(raw) >= RECORD_BYTES:
            raise ValueError(f"lease record of {len(raw)} bytes is too long")
        return raw.ljust(RECORD_BYTES - 1) + b"\n"

    @staticmethod
    def decode(raw: bytes) -> LeaseRecord | None:
        try:
            d = orjson.loads(raw.strip())
            return LeaseRecord(str(d["holder"]), int(d["token"]), str(d["address"]), int(d["beat"]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            return None


def read_lease(state_dir: str) -> LeaseRecord | None:
    try:
        with open(os.path.join(state_dir, LEASE), "rb") as f:
            return LeaseRecord.decode(f.read(RECORD_BYTES))
    except FileNotFoundError:
        return None


def holder_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


class Lease:
    """This coordinator's hold on the lease of a state dir."""

    def __init__(self, state_dir: str, address: str, heartbeat_s: float, holder: str | None = None) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, LEASE)
        self.address = address
        self.heartbeat_s = heartbeat_s
        self.holder = holder or holder_name()
        self.token = 0
        self.beat = 0
        self.renewed_at = time.monotonic()

    # ------------------------------------------------------------------ taking it

    def acquire(self, standby: bool, stopping: Callable[[], bool] = lambda: False) -> bool:
        """Take the lease: at once if there is none or it was released; a standby waits until
        the holder stops renewing it; a primary watches it for STALE_BEATS heartbeats and raises
        LeaseHeld if it is renewed meanwhile (another coordinator serves this state dir)."""
        os.makedirs(self.state_dir, exist_ok=True)
        record = read_lease(self.state_dir)
        if record is None or record.holder == RELEASED:
            if not standby:
                return self._take(record)
            if self._try_take(record):  # two standbys started together: one takes it, the other waits
                return True
            record = read_lease(self.state_dir)
        if standby and record is not None:
            log.info("standby: the lease of %s is held by %s (token %d, serving %s); taking over when it is not "
                     "renewed for %d heartbeats", self.state_dir, record.holder, record.token, record.address,
                     STALE_BEATS)
        if standby:
            return self.wait_until_free(stopping)
        first, deadline = (record.token, record.beat), time.monotonic() + STALE_BEATS * self.heartbeat_s
        while time.monotonic() < deadline:
            time.sleep(self.heartbeat_s / 4)
            now = read_lease(self.state_dir)
            if now is None or now.holder == RELEASED:
                return self._take(now)
            if (now.token, now.beat) != first:
                raise LeaseHeld(f"the coordinator {now.holder} (serving {now.address}) holds the lease of "
                                f"{self.state_dir} and renews it: it is alive; start this one with --standby to "
                                "take over when it is gone")
        log.warning("the lease of %s (holder %s) was not renewed for %d heartbeats: taking it over", self.state_dir,
                    record.holder, STALE_BEATS)
        return self._take(record)

    def wait_until_free(self, stopping: Callable[[], bool] = lambda: False,
                        on_wait: Callable[[LeaseRecord], None] | None = None) -> bool:
        """Watch the lease until nobody renews it for STALE_BEATS heartbeats (or there is none),
        then take it; False if stopping() became true first."""
        last, since = None, time.monotonic()
        told = False
        while not stopping():
            record = read_lease(self.state_dir)
            if record is None or record.holder == RELEASED:
                if record is not None:
                    log.warning("the lease of %s was released by its holder: taking it over", self.state_dir)
                if self._try_take(record):
                    return True
                continue
            key = (record.token, record.beat)
            now = time.monotonic()
            if key != last:
                last, since = key, now
            elif now - since >= STALE_BEATS * self.heartbeat_s:
                log.warning("the lease of %s (holder %s, token %d, serving %s) was not renewed for %.1fs: taking "
                            "it over", self.state_dir, record.holder, record.token, record.address, now - since)
                if self._try_take(record):
                    return True
            if not told and on_wait is not None:
                on_wait(record)
                told = True
            time.sleep(self.heartbeat_s / 4)
        return False

    def _try_take(self, previous: LeaseRecord | None) -> bool:
        try:
            return self._take(previous)
        except LeaseLost as e:  # another standby was quicker
            log.warning("%s; waiting again", e)
            return False

    def _take(self, previous: LeaseRecord | None) -> bool:
        self.token = (previous.token if previous else 0) + 1
        self.beat = 0
        self._write()
        time.sleep(min(0.2, self.heartbeat_s / 2))  # two standbys racing: the last writer wins, the other sees it
        self.check()
        self.renewed_at = time.monotonic()
        log.info("holding the lease of %s with token %d (serving %s)", self.state_dir, self.token, self.address)
        return True

    # ------------------------------------------------------------------ holding it

    def check(self) -> None:
        """Raise LeaseLost if another coordinator's token is in the record."""
        record = read_lease(self.state_dir)
        if record is None or record.token != self.token or record.holder != self.holder:
            who = f"{record.holder} (token {record.token}, serving {record.address})" if record else "nobody"
            raise LeaseLost(f"the lease of {self.state_dir} is held by {who}, not by this coordinator (token "
                            f"{self.token})")

    def renew(self) -> None:
        """Check, then advance the beat in place. Raises LeaseLost, or OSError (not renewed)."""
        self.check()
        self.beat += 1
        self._write()
        self.renewed_at = time.monotonic()

    def overdue(self) -> bool:
        """Not renewed for SELF_FENCE_BEATS heartbeats: stop serving before a standby may start."""
        return time.monotonic() - self.renewed_at >= SELF_FENCE_BEATS * self.heartbeat_s

    def _write(self) -> None:
        record = LeaseRecord(self.holder, self.token, self.address, self.beat).encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, record, 0)  # same size, same place: no new blocks, works on a full disk
            os.fsync(fd)
        finally:
            os.close(fd)

    def release(self) -> None:
        """On a clean stop: give the lease up (a standby, or the next start, takes it at once)."""
        try:
            self.check()
            self.holder = RELEASED
            self._write()
        except (LeaseLost, OSError) as e:
            log.warning("lease of %s not released (%s)", self.state_dir, e)
