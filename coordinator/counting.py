"""Record counts from the workers, before the coordinator plans (`runtime.index_on: workers`).

The coordinator needs each source's record count before it can plan; a JSONL or WebDataset
shard's count is its index's, and building indexes (scanning, decompressing) is the bulk of a
cold start. With `index_on: coordinator` this host builds them, with all its cores, before it
listens. With `index_on: workers` it builds none: it binds its control socket, welcomes every
worker that says hello with the job and the sources it wants counted, and the worker processes
of every host build what their host lacks (sharing the shards by a lock each, as they do at
every welcome) and answer with the counts (`source_counts`). Once every source is counted, the
same socket is handed to the coordinator proper; the workers welcomed here are told to say hello
again (`unknown_peer`), and the coordinator registers them as usual.

Only workers and their host agents are served here: a host agent is told to run as many
processes as it may (`--procs auto --max-procs N`: indexing is work for all of them; the
coordinator shrinks idle hosts later as usual). Trainers and `msd mix` wait (their hellos are
not answered and they say hello again); `msd status` is answered with the counting's progress. Two
workers that count one source differently see different files, and the job is refused, naming
both hosts.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any, Callable

import orjson
import zmq

from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import ProtocolError
from msd_common.sockets import raise_fd_limit

from msd_common.spec import ConfigError, JobConfig
from .lease import Lease
from .router import Router
from .sources import OpenedSources
from .welcome import host_scale, version_refusal, worker_welcome

log = logging.getLogger("msd.coordinator")

PROGRESS_EVERY_S = 10.0


class Stopped(Exception):
    """SIGINT or SIGTERM while the workers were counting."""


def catch_stop_signals(into: list[int]) -> dict[int, Any]:
    """Catch SIGINT and SIGTERM into `into` (in the main thread; elsewhere signals cannot be
    caught, and nothing is done); returns the handlers they replaced, to put back."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, lambda signum, _: into.append(signum)) for sig in (signal.SIGINT, signal.SIGTERM)}


class _Counting:
    """What the counting phase knows: the sources asked for, who counted what, whom it welcomed."""

    def __init__(self, job: JobConfig, pending: dict[int, list[str]]) -> None:
        self.job = job
        self.pending = pending
        self.counts: dict[int, tuple[int, str]] = {}  # source -> (records, host that counted it)
        self.problems: dict[int, str] = {}  # source -> why a worker could not open it
        self.welcomed: dict[bytes, str] = {}  # peer -> its host
        self.hosts: set[bytes] = set()  # host agents answered
        self.next_id = 0

    @property
    def done(self) -> bool:
        return all(s in self.counts or s in self.problems for s in self.pending)

    def handle(self, peer: bytes, msg: P.Message) -> P.Message | None:
        """The answer to one message, if it gets one."""
        if isinstance(msg, P.WorkerHello):
            refusal = version_refusal(msg.version, f"worker from {msg.host}")
            if refusal is not None:
                return refusal
            self.welcomed[peer] = msg.host
            self.next_id += 1
            return worker_welcome(self.job, self.next_id - 1, count=self.pending)
        if isinstance(msg, P.WorkerHeartbeat):
            return P.Alive() if peer in self.welcomed else None
        if isinstance(msg, P.HostHello):  # indexing is work for every process a host may run
            refusal = version_refusal(msg.version, f"worker host {msg.host}")
            if refusal is not None:
                return refusal
            self.hosts.add(peer)
            return host_scale(self.job, msg.max_procs, [], "indexing the job's shards")
        if isinstance(msg, P.HostHeartbeat):
            return P.Alive() if peer in self.hosts else None
        if isinstance(msg, P.SourceCounts) and peer in self.welcomed:
            self._counted(self.welcomed[peer], msg)
        elif isinstance(msg, P.StatusRequest):
            return P.StatusReply(status=self.status())
        return None

    def _counted(self, host: str, msg: P.SourceCounts) -> None:
        names = [s.name for s in self.job.sources]
        for s, records, problem in zip(msg.sources, msg.records, msg.problems):
            if s not in self.pending:
                continue
            if problem:
                self.problems.setdefault(s, f"sources.{names[s]}: {problem} (on host {host})")
            elif s not in self.counts:
                self.counts[s] = (records, host)
            elif self.counts[s][0] != records:
                self.problems[s] = (f"sources.{names[s]}: host {self.counts[s][1]} counts {self.counts[s][0]} "
                                    f"records, host {host} {records}: the hosts see different files")

    def status(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps({
            "time": time.time(), "job": self.job.path, "digest": self.job.digest(), "dp": self.job.dp,
            "counting": {"sources": len(self.pending), "counted": len(self.counts),
                         "shards_to_index": sum(len(v) for v in self.pending.values()),
                         "workers": len(self.welcomed)},
            "warnings": [],
        }))


def count_on_workers(job: JobConfig, opened: OpenedSources, bind: str, lease: Lease | None = None,
                     on_bound: Callable[[str], None] | None = None,
                     stop: list[int] | None = None) -> tuple[OpenedSources, Router]:
    """Serve workers at `bind` until every pending source of `opened` is counted; returns the
    sources with their counts and the bound socket, for the Coordinator. The lease on the state
    dir, if any, is renewed meanwhile; on_bound(address) is called once the socket listens.
    stop: the stop signals the caller catches (serving.serve, which keeps catching them until its
    loop takes them); without it, SIGINT and SIGTERM are caught here while counting. Raises
    ConfigError for a source the workers cannot open (or count alike), Stopped on a stop signal,
    LeaseLost if another coordinator took the state dir."""
    raise_fd_limit("coordinator")
    counting = _Counting(job, opened.pending)
    router = Router.open(job, bind)
    if lease is not None:
        lease.address = router.address
    previous = {}
    if stop is None:
        stop = []
        previous = catch_stop_signals(stop)
    shards = sum(len(v) for v in opened.pending.values())
    log.info("listening on %s; waiting for workers to index %d shard(s) and count %d source(s) (runtime.index_on: "
             "workers)", router.address, shards, len(opened.pending))
    if on_bound is not None:
        on_bound(router.address)
    started = last_report = renewed = time.monotonic()
    try:
        while not counting.done:
            if stop:
                raise Stopped(f"signal {stop[0]}")
            if lease is not None and time.monotonic() - renewed >= job.runtime.heartbeat_s:
                renewed = time.monotonic()
                try:
                    lease.renew()  # (LeaseLost: another coordinator serves the state dir now)
                except OSError as e:
                    if lease.overdue():  # as the coordinator does: stop before a standby may start
                        raise Stopped(f"the lease of the state dir could not be renewed: {e}") from None
                    log.warning("renewing the lease of the state dir failed (%s); trying again", e)
            if router.sock.poll(250, zmq.POLLIN):
                _serve_one(router.sock, counting)
            now = time.monotonic()
            if now - last_report >= PROGRESS_EVERY_S:
                last_report = now
                log.info("counting on workers: %d of %d source(s) counted, %d worker(s) welcomed, %.0f s so far",
                         len(counting.counts), len(opened.pending), len(counting.welcomed), now - started)
        if counting.problems:
            raise ConfigError(job.path, [counting.problems[s] for s in sorted(counting.problems)])
        counts = {s: records for s, (records, _) in counting.counts.items()}
        sources = opened.with_counts(job, counts)
    except BaseException:
        router.close()
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    log.info("workers counted %d source(s) (%s) in %.1f s (%d worker process(es) on %d host(s))", len(counts),
             ", ".join(f"{job.sources[s].name}={n}" for s, n in sorted(counts.items())), time.monotonic() - started,
             len(counting.welcomed), len(set(counting.welcomed.values())))
    for peer in [*counting.welcomed, *counting.hosts]:  # registered here, not with the coordinator: hello again
        _send(router.sock, peer, P.UnknownPeer(reason="the sources are counted; the coordinator now plans the job"))
    return sources, router


def _serve_one(sock: zmq.Socket, counting: _Counting) -> None:
    frames = sock.recv_multipart(copy=True)
    try:
        msg = wire.receive(frames[1:], P.COORDINATOR_INBOX)
    except ProtocolError as e:
        log.warning("dropped message from peer %s: %s", frames[0].hex(), e)
        return
    answer = counting.handle(frames[0], msg)
    if answer is not None:
        _send(sock, frames[0], answer)


def _send(sock: zmq.Socket, peer: bytes, message: P.Message) -> None:
    try:
        sock.send_multipart([peer, *wire.encode(message)], flags=zmq.NOBLOCK)
    except zmq.ZMQError as e:  # a peer gone or not reading: it says hello again
        log.info("send of %s to %s failed: %s", message.TYPE, peer.hex(), e)
