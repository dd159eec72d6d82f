"""The coordinator process: one asyncio loop (uvloop) around one ZeroMQ ROUTER socket.

It owns the registry of workers and trainer ranks, the planner, the prepare-ahead bookkeeping
(which worker holds which prepared record) and the deliveries not yet acknowledged. It handles
metadata only: payload bytes go from workers straight to trainer ranks and never pass here.

Flow: receive -> decode and validate (a bad message is logged and dropped) -> handler updates
state -> `_pump()` plans what may be planned and issues prepare tasks -> `_send()`, the one place
that sends. Time enters through `_tick()` on a monotonic clock (heartbeats, dead peers).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import zmq
import zmq.asyncio

from trainer_client import memory, security
from trainer_client import protocol as P
from trainer_client import wire
from trainer_client.errors import MsdError, ProtocolError
from trainer_client.sockets import make_socket

from .balance import COMPILED, imbalance
from .cursor import COMPILED as PERMUTATION_COMPILED
from .config import JobConfig, config_diff
from .journal import StepJournal
from .positions import NOBODY, PositionTable
from .sources import OpenedSources
from .workforce import HostInfo, Workforce
from .plan import LENGTH, OFFSET, POSITION, RECORD, SOURCE, NeedLength, Planner, SourceExhausted, StepPlan

log = logging.getLogger("msd.coordinator")
MAX_BURST = 256  # messages handled before the next planning pass
_MESSAGES_OF = {
    "worker": {"worker_heartbeat", "prepared", "task_failed", "delivered"},
    "trainer": {"consumed", "trainer_heartbeat", "trainer_bye"},
    "host": {"host_heartbeat"},
}
_ID_FIELD = {"worker": "worker_id", "trainer": "rank", "host": "agent_id"}


@dataclass
class WorkerInfo:
    worker_id: int
    identity: bytes
    last_seen: float
    tasks: set[int] = field(default_factory=set)
    deliveries: set[int] = field(default_factory=set)
    acked: set[int] = field(default_factory=set)  # its deliveries acknowledged, not yet consumed by all ranks
    agent: int = 0  # its host agent
    pid: int = 0
    busy_s: float = 0.0  # total time it reports busy (heartbeats)
    backlog_s: float = 0.0  # estimated seconds of its prepare tasks in flight


@dataclass
class TrainerInfo:
    rank: int
    identity: bytes
    address: str
    last_seen: float
    consumed: int = -1  # last step this rank has fully consumed
    waited_s: float = 0.0  # total time its trainer waited for data (reported with `consumed`)


@dataclass
class PrepareTask:
    task_id: int
    source: int
    positions: np.ndarray
    worker_id: int
    estimate_s: float = 0.0


@dataclass
class Delivery:
    """One DELIVER sent to one worker, kept until the worker acknowledges it."""

    delivery_id: int
    worker_id: int
    step: int
    items: np.ndarray  # [rank, piece, doc_key, offset, length] rows, as sent (piece: index in the rank's recipe)
    positions: np.ndarray  # [source, stream position] of each item's record
    release: np.ndarray  # [source, position] of prepared copies used up by it
    ranks: list[int] = field(default_factory=list)  # the ranks it sends to


class Coordinator:
    def __init__(self, job: JobConfig, sources: OpenedSources, bind: str = "tcp://127.0.0.1:5555",
                 state_dir: str | None = None, allow_config_change: bool = False) -> None:
        self.job = job
        self.bind = bind
        self.planner = Planner(job, sources.num_records)
        self.topology = job.topology
        self.receivers = set(job.topology.receivers())  # global ranks that get data
        self.state_dir = state_dir
        for at_step, weights in read_mixture_journal(state_dir):  # run-time changes of an earlier run
            self.planner.set_weights(at_step, weights)
            log.info("mixture journal: weights %s from step %d", weights, at_step)
        self.digest = job.digest()
        self.heartbeat_s = job.runtime.heartbeat_s
        self.workers: dict[int, WorkerInfo] = {}
        self.trainers: dict[int, TrainerInfo] = {}
        self.peers: dict[bytes, tuple[str, int]] = {}  # socket identity -> ("worker"|"trainer"|"host", id)
        self.workforce = Workforce(len(job.sources), job.runtime.allocation, job.runtime.shrink_after_s)
        n = len(job.sources)
        self.tables = [PositionTable() for _ in range(n)]  # per source: record, length, holder by position
        # Memory-mapped sources: their lengths are in an index the coordinator opened at start-up,
        # so their records need no prepare round trip (a worker reads them straight from the map).
        self.mapped = sources.mapped
        changed = check_job_change(state_dir, job, allow_config_change)
        self.journal = StepJournal(state_dir, self.digest, accept_changed_job=changed)
        restored = self.journal.latest
        if restored is not None:  # a restart: carry on where the last run's plan stood
            self.planner.state = restored
            log.info("state restored from %s: the plan stands at step %d (steps %d.. can be resumed)", state_dir,
                     restored.next_step, self.journal.oldest)
        else:
            self.journal.record(self.planner.state)
        self._reset_tables()
        self.len_sum = [0] * n
        self.len_count = [0] * n
        self.skipped = [0] * n
        self.tasks: dict[int, PrepareTask] = {}
        self.deliveries: dict[int, Delivery] = {}
        self.orphans: list[Delivery] = []  # deliveries of dead workers, waiting for re-prepare
        self.acked: dict[int, Delivery] = {}  # acknowledged deliveries of steps some rank has not consumed
        self.reprepare: set[tuple[int, int]] = set()  # positions lost with a dead worker
        self._next_worker_id = 0
        self._next_task_id = 0
        self._next_delivery_id = 0
        self.sock: zmq.asyncio.Socket | None = None
        self.stopped = asyncio.Event()
        self.failed = False
        self.end: tuple[int, str] | None = None  # (first step that will never be planned, why)
        self.waiting: tuple[int, int] | None = None  # (source, position) whose length planning waits for
        self.messages_received = self.messages_sent = 0
        self.address: str | None = None

    # ------------------------------------------------------------------ sockets and loops

    async def run(self, ready: asyncio.Future | None = None) -> None:
        memory.keep_freed_memory()
        ctx = zmq.asyncio.Context()
        auth = None
        self.sock = make_socket(ctx, zmq.ROUTER, hwm=100_000)
        if self.job.curve_keys:  # only workers and trainers holding an authorised key get through
            auth = security.start_authenticator(ctx, self.job.curve_keys)
            security.as_server(self.sock, security.load(self.job.curve_keys, "coordinator"))
        try:
            self.sock.bind(self.bind)
            self.address = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            log.info("coordinator for %s (digest %s) listening on %s", self.job.path, self.digest, self.address)
            if not (COMPILED and PERMUTATION_COMPILED):
                log.warning("coordinator._greedy or _feistel is not built (no C compiler at install?): the planner "
                            "runs in Python, several times slower; reinstall with a compiler to fix")
            if ready is not None:
                ready.set_result(self.address)
            tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._tick_loop())]
            await self.stopped.wait()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._broadcast_shutdown("coordinator stopping")
            self.journal.close()
        finally:
            self.sock.close(linger=500)
            if auth is not None:
                auth.stop()
            ctx.term()

    def stop(self) -> None:
        self.stopped.set()

    async def _receive_loop(self) -> None:
        while True:
            self._receive(await self.sock.recv_multipart(copy=False))
            # Take what else has arrived before planning: one plan-and-dispatch pass per burst of
            # messages instead of one per message (the per-pass cost does not depend on the count).
            for _ in range(MAX_BURST):
                try:
                    frames = self.sock.recv_multipart(flags=zmq.NOBLOCK, copy=False).result()
                except zmq.Again:
                    break
                self._receive(frames)
            self._pump_or_stop()

    def _receive(self, frames: list) -> None:
        self.messages_received += 1
        identity = frames[0].bytes
        try:
            header, arrays = wire.decode(frames[1:], P.COORDINATOR_INBOX)
        except ProtocolError as e:
            log.warning("dropped message from peer %s: %s", identity.hex(), e)
            return
        try:
            self._handle(identity, header, arrays)
        except Exception:  # one message we could not handle: log it, drop it, serve the rest
            log.exception("error handling %s from %s", header.get("type"), identity.hex())

    async def _tick_loop(self) -> None:
        last_status = time.monotonic()
        while True:
            await asyncio.sleep(self.heartbeat_s)
            now = time.monotonic()
            self._tick(now)
            self._pump_or_stop()
            if now - last_status >= self.job.runtime.status_every_s:
                status = self.status()
                log.info("status: %s", status)
                if self.state_dir:
                    write_json_atomically(os.path.join(self.state_dir, "status.json"), status)
                last_status = now

    def _pump_or_stop(self) -> None:
        """Planning and dispatch keep invariants across steps; after an unexpected error there,
        carrying on could deliver a wrong stream or stall it silently, so the coordinator stops
        (with a non-zero exit) and the job can be restarted from its state."""
        try:
            self._pump()
        except Exception:
            log.critical("internal error while planning step %d; stopping the coordinator",
                         self.planner.state.next_step, exc_info=True)
            self.failed = True
            self.stop()

    def _send(self, identity: bytes, header: dict[str, Any], *arrays: np.ndarray) -> None:
        # NOBLOCK: a slow or vanished peer must never stall the coordinator. zmq.asyncio reports
        # the outcome through a future that is already done for a non-blocking send.
        self.messages_sent += 1
        fut = self.sock.send_multipart([identity, *wire.encode(header, *arrays)], flags=zmq.NOBLOCK)
        fut.add_done_callback(lambda f: self._sent(f, identity, header["type"]))

    @staticmethod
    def _sent(fut: asyncio.Future, identity: bytes, kind: str) -> None:
        exc = None if fut.cancelled() else fut.exception()
        if isinstance(exc, zmq.Again):
            log.error("send of %s dropped: peer %s is not reading (high-water mark)", kind, identity.hex())
        elif isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH:
            log.info("send of %s to %s: peer has disconnected", kind, identity.hex())
        elif exc is not None:
            log.warning("send of %s to %s failed: %s", kind, identity.hex(), exc)

    def _broadcast_shutdown(self, reason: str) -> None:
        for w in self.workers.values():
            self._send(w.identity, P.make(P.SHUTDOWN, reason=reason))
        for t in self.trainers.values():
            self._send(t.identity, P.make(P.SHUTDOWN, reason=reason))

    # ------------------------------------------------------------------ message handlers

    def _handle(self, identity: bytes, msg: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
        kind = msg["type"]
        now = time.monotonic()
        if kind == "worker_hello":
            return self._on_worker_hello(identity, msg, now)
        if kind == "trainer_hello":
            return self._on_trainer_hello(identity, msg, now)
        if kind == "mix_request":
            return self._on_mix_request(identity, msg)
        if kind == "host_hello":
            return self._on_host_hello(identity, msg, now)
        peer = self.peers.get(identity)
        if peer is None:
            log.warning("%s from unregistered peer %s dropped; asked it to say hello", kind, identity.hex())
            self._send(identity, P.make(P.UNKNOWN_PEER, reason="not registered: send a hello first"))
            return
        role, pid = peer
        if kind not in _MESSAGES_OF[role]:
            log.warning("%s %d sent %s, which a %s does not send; dropped", role, pid, kind, role)
            return
        claimed = msg[_ID_FIELD[role]]
        if claimed != pid:
            log.warning("%s %d claims to be %s %d; dropped", role, pid, role, claimed)
            return
        if role == "host":
            host = self.workforce.hosts[pid]
            host.last_seen, host.procs = now, msg["procs"]
            return
        if role == "worker":
            worker = self.workers[pid]
            worker.last_seen = now
            if kind == "worker_heartbeat":
                worker.busy_s = max(worker.busy_s, msg["busy_s"])
            elif kind == "prepared":
                self._on_prepared(worker, msg, arrays["lengths"], arrays["patches"])
            elif kind == "task_failed":
                self._on_task_failed(worker, msg)
            elif kind == "delivered":
                self._on_delivered(worker, msg["delivery_id"])
            return
        trainer = self.trainers[pid]
        trainer.last_seen = now
        if kind == "consumed":
            trainer.consumed = max(trainer.consumed, min(msg["step"], self.planner.state.next_step - 1))
            trainer.waited_s = max(trainer.waited_s, msg["waited_s"])
        elif kind == "trainer_bye":
            log.info("rank %d left", pid)
            del self.trainers[pid]
            del self.peers[identity]

    def _on_worker_hello(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        if msg["version"] != P.PROTOCOL_VERSION:
            log.warning("worker from %s speaks protocol %d, we speak %d: rejected", msg["host"], msg["version"],
                        P.PROTOCOL_VERSION)
            self._send(identity, P.make(P.REJECT, reason=f"protocol version {msg['version']} != {P.PROTOCOL_VERSION}"))
            return
        if identity in self.peers:
            self._forget_peer(identity, "re-registered")
        wid = self._next_worker_id
        self._next_worker_id += 1
        self.workers[wid] = WorkerInfo(wid, identity, now, agent=msg["agent"], pid=msg["pid"])
        self.peers[identity] = ("worker", wid)
        log.info("worker %d registered (host %s pid %d)", wid, msg["host"], msg["pid"])
        self._send(identity, P.make(P.WELCOME, worker_id=wid, job=self.job.worker_job(), heartbeat_s=self.heartbeat_s))

    def _on_host_hello(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        if msg["version"] != P.PROTOCOL_VERSION:
            self._send(identity, P.make(P.REJECT, reason=f"protocol version {msg['version']} != {P.PROTOCOL_VERSION}"))
            return
        if identity in self.peers:
            self._forget_peer(identity, "re-registered")
        aid = msg["agent_id"]
        old = self.workforce.hosts.pop(aid, None)
        if old is not None:
            self.peers.pop(old.identity, None)
        host = HostInfo(aid, identity, msg["host"], msg["procs"], msg["min_procs"], msg["max_procs"], bool(msg["auto"]),
                        now)
        self.workforce.hosts[aid] = host
        self.peers[identity] = ("host", aid)
        log.info("worker host %s registered: %d process(es)%s", host.host, host.procs,
                 f", auto up to {host.max_procs}" if host.auto else "")
        self._send(identity, P.make(P.SCALE, procs=host.procs, retire=[], reason="registered"))

    def _on_trainer_hello(self, identity: bytes, msg: dict[str, Any], now: float) -> None:
        rank = msg["rank"]
        reason = None
        if msg["version"] != P.PROTOCOL_VERSION:
            reason = f"protocol version {msg['version']} != {P.PROTOCOL_VERSION}"
        elif rank >= self.topology.world_size:
            reason = f"rank {rank} out of range: the topology has {self.topology.world_size} ranks"
        elif not self.topology.fields(rank, want_metadata=bool(msg["metadata_only"])):
            reason = (f"rank {rank} {self.topology.coords(rank)} receives no data (delivery "
                      f"{self.topology.delivery!r}, pp {self.topology.pp}): it needs no DataClient "
                      "(a middle pipeline stage may ask for the metadata: metadata_only=True)")
        elif msg["resume_step"] > self.planner.state.next_step:
            reason = (f"cannot resume at step {msg['resume_step']}: the plan stands at step "
                      f"{self.planner.state.next_step}")
        elif msg["resume_step"] < self.planner.state.next_step and self.journal.state_before(msg["resume_step"]) is None:
            reason = (f"cannot resume at step {msg['resume_step']}: the coordinator keeps steps from "
                      f"{self.journal.oldest} on (the journal was compacted)")
        if reason:
            log.warning("trainer rank %d rejected: %s", rank, reason)
            self._send(identity, P.make(P.REJECT, reason=reason))
            return
        old = self.trainers.get(rank)
        if old is not None and old.identity != identity and now - old.last_seen < 3 * self.heartbeat_s:
            # Another client holds this rank and is alive: two trainers must never share a rank.
            # The newcomer keeps asking; the rank is its once the holder leaves or goes silent.
            log.warning("rank %d claimed by a second client while the first is alive; refused", rank)
            self._send(identity, P.make(P.RANK_TAKEN, rank=rank, reason=f"rank {rank} is held by a live client"))
            return
        if msg["resume_step"] < self.planner.state.next_step:
            self._rewind(msg["resume_step"])
        if old is not None and old.identity != identity:
            self.peers.pop(old.identity, None)
        if identity in self.peers and self.peers[identity] != ("trainer", rank):
            self._forget_peer(identity, "re-registered")
        info = TrainerInfo(rank, identity, msg["data_address"], now, msg["resume_step"] - 1)
        self.trainers[rank] = info
        self.peers[identity] = ("trainer", rank)
        log.info("rank %d registered, data address %s", rank, msg["data_address"])
        batch = {
            "seq_len": self.job.batch.seq_len,
            "micro_batch_size": self.job.batch.micro_batch_size,
            "micro_batches": self.job.micro_batches_per_rank,
            "pad_id": self.job.batch.pad_id,
            "dp": self.job.dp,
            "topology": self.topology._asdict(),
            "sources": [s.name for s in self.job.sources],
            "patch_bytes": self.job.patch_bytes,  # 0: no image-text source
        }
        self._send(identity, P.make(P.TRAINER_WELCOME, rank=rank, batch=batch, plan_digest=self.digest,
                                    heartbeat_s=self.heartbeat_s))
        if self.end is not None:
            self._send(identity, P.make(P.END_OF_STREAM, step=self.end[0], reason=self.end[1]))

    def _on_mix_request(self, identity: bytes, msg: dict[str, Any]) -> None:
        """New weights from a later step on (msd mix): checked, journaled, then applied."""
        at_step, raw = msg["at_step"], msg["weights"]
        names = [s.name for s in self.job.sources]
        problems = []
        if not isinstance(raw, dict) or not raw:
            problems.append("weights: expected a non-empty map of source name -> weight")
            raw = {}
        for name, w in raw.items():
            if name not in names:
                problems.append(f"{name}: unknown source (sources: {', '.join(names)})")
            elif type(w) not in (int, float) or not math.isfinite(w) or w < 0:
                problems.append(f"{name}: weight must be a finite number >= 0, got {w!r}")
        if not problems and sum(raw.values()) <= 0:
            problems.append("weights: all zero")
        if at_step < self.planner.state.next_step:
            problems.append(f"step {at_step} is already planned (the plan stands at step "
                            f"{self.planner.state.next_step}); choose a later step")
        if problems:
            self._send(identity, P.make(P.MIX_REPLY, ok=0, reason="; ".join(problems), at_step=at_step))
            return
        weights = [float(raw.get(name, 0.0)) for name in names]
        if self.state_dir:
            append_mixture_journal(self.state_dir, at_step, weights)
        self.planner.set_weights(at_step, weights)
        log.warning("mixture changed from step %d: %s", at_step, dict(zip(names, weights)))
        self._send(identity, P.make(P.MIX_REPLY, ok=1, reason="", at_step=at_step))

    def _take_task(self, worker: WorkerInfo, task_id: int) -> PrepareTask | None:
        """The task a worker reports on, no longer in flight (its estimate leaves its owner's backlog)."""
        task = self.tasks.pop(task_id, None)
        worker.tasks.discard(task_id)
        owner = self.workers.get(task.worker_id) if task is not None else None
        if owner is not None:
            owner.tasks.discard(task_id)
            owner.backlog_s = max(0.0, owner.backlog_s - task.estimate_s)
        return task

    def _on_prepared(self, worker: WorkerInfo, msg: dict[str, Any], lengths: np.ndarray, patches: np.ndarray) -> None:
        task = self._take_task(worker, msg["task_id"])
        if task is None or task.worker_id != worker.worker_id:
            log.debug("result of unknown or reassigned task %d ignored", msg["task_id"])
            return
        if len(lengths) != len(task.positions):
            log.warning("worker %d: task %d returned %d lengths for %d records; re-issuing", worker.worker_id,
                        task.task_id, len(lengths), len(task.positions))
            self._issue_prepare(task.source, task.positions)
            return
        s = task.source
        for i, reason in msg["skipped"]:
            self.skipped[s] += 1
            log.warning("source %s: record skipped: %s (%d skipped so far)", self.job.sources[s].name, reason,
                        self.skipped[s])
        lengths = np.asarray(lengths, dtype=np.int64)
        self.workforce.record(s, msg["busy_s"], len(lengths), int(lengths.sum()))
        self._set_prepared(s, task.positions, lengths, worker.worker_id, patches)

    def _set_prepared(self, s: int, positions: np.ndarray, lengths: np.ndarray, worker_id: int,
                      patches: np.ndarray | None = None) -> None:
        """The records at these positions of source s are prepared, held by the worker."""
        before = self.tables[s].set_prepared(positions, lengths, worker_id, patches)
        changed = (before >= 0) & (before != lengths)
        for pos, was, now in zip(positions[changed].tolist(), before[changed].tolist(), lengths[changed].tolist()):
            log.error("source %s position %d: length %d differs from earlier %d (non-deterministic transform?)",
                      self.job.sources[s].name, pos, now, was)
        new = before < 0
        self.len_sum[s] += int(lengths[new].sum())
        self.len_count[s] += int(new.sum())
        if self.reprepare:
            self.reprepare.difference_update((s, p) for p in positions.tolist())
        if self.orphans:
            self._reissue_orphans()

    def _on_delivered(self, worker: WorkerInfo, delivery_id: int) -> None:
        d = self.deliveries.pop(delivery_id, None)
        worker.deliveries.discard(delivery_id)
        if d is None:
            log.debug("ack of unknown delivery %d", delivery_id)
            return
        # Only now is a used-up record really gone: until the ack, a worker death means re-preparing it.
        for s in np.unique(d.release[:, 0]).tolist():
            self.tables[s].release(d.release[d.release[:, 0] == s, 1])
        # The ack says the worker queued the pieces, not that they arrived: a worker killed right
        # after it loses what its socket had not sent yet. Keep the delivery until its ranks have
        # consumed the step, to send it again if its worker dies before that.
        self.acked[delivery_id] = d
        worker.acked.add(delivery_id)

    def _on_task_failed(self, worker: WorkerInfo, msg: dict[str, Any]) -> None:
        task = self._take_task(worker, msg["task_id"])
        log.error("worker %d failed task %d: %s", worker.worker_id, msg["task_id"], msg["reason"])
        if task is not None:
            self._issue_prepare(task.source, task.positions, avoid=worker.worker_id)

    # ------------------------------------------------------------------ time and failures

    def _tick(self, now: float) -> None:
        deadline = 3 * self.heartbeat_s
        for w in [w for w in self.workers.values() if now - w.last_seen > deadline]:
            log.warning("worker %d silent for %.1fs: declared dead", w.worker_id, now - w.last_seen)
            self._forget_peer(w.identity, "dead")
        for t in [t for t in self.trainers.values() if now - t.last_seen > deadline]:
            log.warning("rank %d silent for %.1fs: released (it may register again)", t.rank, now - t.last_seen)
            self._forget_peer(t.identity, "dead")
        for h in [h for h in self.workforce.hosts.values() if now - h.last_seen > deadline]:
            log.warning("worker host %s silent for %.1fs: forgotten", h.host, now - h.last_seen)
            self._forget_peer(h.identity, "dead")
        self._scale_hosts(now)

    def _scale_hosts(self, now: float) -> None:
        for host, procs in self.workforce.decide(now, self.workers, self.trainers):
            log.info("worker host %s: %d -> %d processes (trainers wait %.0f%% of the time, workers %.0f%% busy)",
                     host.host, host.procs, procs, 100 * self.workforce.last_wait, 100 * self.workforce.last_busy)
            host.procs = procs
            self._send(host.identity, P.make(P.SCALE, procs=procs, retire=[], reason="trainers wait for data"))
        for host in self.workforce.hosts.values():
            for wid in sorted(host.retiring):
                w = self.workers.get(wid)
                if w is None:  # died meanwhile: its agent restarts it, so the count stays
                    host.retiring.discard(wid)
                elif not (w.tasks or w.deliveries or w.acked or any(t.count_held(wid) for t in self.tables)):
                    host.retiring.discard(wid)
                    host.procs -= 1
                    log.info("worker host %s: worker %d holds nothing; stopping it (%d processes)", host.host, wid,
                             host.procs)
                    self._send(host.identity, P.make(P.SCALE, procs=host.procs, retire=[w.pid], reason="idle"))
                    self.peers.pop(w.identity, None)
                    del self.workers[wid]

    def _forget_peer(self, identity: bytes, why: str) -> None:
        role, pid = self.peers.pop(identity)
        if role == "trainer":
            self.trainers.pop(pid, None)
            return
        if role == "host":
            self.workforce.hosts.pop(pid, None)
            return
        worker = self.workers.pop(pid)
        log.info("worker %d %s: re-preparing its tasks and cached records elsewhere", pid, why)
        for tid in sorted(worker.tasks):
            task = self.tasks.pop(tid)
            self._issue_prepare(task.source, task.positions)
        lost = {s: t.held_by(pid) for s, t in enumerate(self.tables)}
        for s, positions in lost.items():
            self.reprepare.update((s, p) for p in positions.tolist())
        for did in sorted(worker.deliveries):
            self.orphans.append(self.deliveries.pop(did))
        for did in sorted(worker.acked):  # acknowledged, but maybe never sent: again, from new copies
            d = self.acked.pop(did)
            self.orphans.append(d)
            for rows in (d.positions, d.release):
                for s in np.unique(rows[:, 0]).tolist():
                    positions = np.unique(rows[rows[:, 0] == s, 1])
                    gone = positions[self.tables[s].holders(positions) == NOBODY]
                    lost[s] = np.union1d(lost[s], gone)
                    self.reprepare.update((s, p) for p in gone.tolist())
        for s, positions in lost.items():
            if len(positions):
                self._issue_prepare(s, positions)
        self._reissue_orphans()  # those whose records all have live holders can go at once

    def _reissue_orphans(self) -> None:
        """Send deliveries of dead workers again, once every record they read has a live holder.
        Trainer clients drop pieces they already have, so a repeated piece is harmless."""
        # In step order, and none after one that must wait: a later step's delivery may release a
        # record an earlier step still reads (the worker would drop it before the earlier one came).
        waiting = []
        for d in sorted(self.orphans, key=lambda d: (d.step, d.delivery_id)):
            needed = {tuple(pos) for pos in d.positions.tolist()} | {tuple(pos) for pos in d.release.tolist()}
            if waiting or needed & self.reprepare:
                waiting.append(d)
            else:
                self._send_deliveries(d.step, d.items, d.positions, d.release)
        self.orphans = waiting

    # ------------------------------------------------------------------ planning and dispatch

    def _pump(self) -> None:
        self._forget_consumed()
        if not self.workers or not self.receivers <= self.trainers.keys():
            return
        for task in [t for t in self.tasks.values() if t.worker_id < 0]:  # queued while no worker lived
            del self.tasks[task.task_id]
            self._issue_prepare(task.source, task.positions)
        if self.reprepare:
            # Records lost with a dead worker are being prepared again; a carried-over document may
            # be among them, so plan nothing until every record has a live holder again.
            self._prepare_ahead()
            return
        limit = min(t.consumed for t in self.trainers.values()) + 1 + self.job.runtime.lookahead_steps
        planned = []
        while self.end is None and self.planner.state.next_step < limit:
            if self.waiting is not None and self.tables[self.waiting[0]].window(self.waiting[1], 1)[1][0] < 0:
                break  # the length the last attempt stopped at is still not in: planning would stop there again
            self.waiting = None
            try:
                plan = self.planner.plan_step(self)
            except NeedLength as need:  # nothing changed: plan again once the length is in
                self.waiting = (need.source, need.position)
                self._ensure_prepared(need.source, need.position)
                break
            except SourceExhausted as e:
                log.warning("%s: the stream ends before step %d", e, e.step)
                self.end = (e.step, str(e))
                for t in self.trainers.values():
                    self._send(t.identity, P.make(P.END_OF_STREAM, step=e.step, reason=str(e)))
                break
            finally:
                for event in self.planner.events:
                    log.warning("%s", event)
                self.planner.events.clear()
            self.journal.record(self.planner.state)
            planned.append(plan)
        self.journal.flush()  # the steps are durable before any of their deliveries goes out
        for plan in planned:
            self._dispatch(plan)
            if plan.step % 32 == 0:
                self._forget_old()
        self._prepare_ahead()

    def _forget_consumed(self) -> None:
        """Acknowledged deliveries whose step every one of their ranks has consumed are done."""
        for did, d in list(self.acked.items()):
            if all(r in self.trainers and self.trainers[r].consumed >= d.step for r in d.ranks):
                del self.acked[did]
                worker = self.workers.get(d.worker_id)
                if worker is not None:
                    worker.acked.discard(did)

    def _forget_old(self) -> None:
        """Drop position-table entries nothing can refer to any more: below the planner's cursor
        (and the document it carries), every unacknowledged delivery and every prepare in flight."""
        floor = list(self.planner.state.cursors)
        for s, carry in enumerate(self.planner.state.carry):
            if carry is not None:
                floor[s] = min(floor[s], carry[0])
        for d in [*self.deliveries.values(), *self.orphans, *self.acked.values()]:
            for rows in (d.positions, d.release):
                for s in np.unique(rows[:, 0]).tolist():
                    floor[s] = min(floor[s], int(rows[rows[:, 0] == s, 1].min()))
        for t in self.tasks.values():
            if len(t.positions):
                floor[t.source] = min(floor[t.source], int(t.positions.min()))
        for s, table in enumerate(self.tables):
            table.forget_before(floor[s])

    def patches(self, source: int, positions: np.ndarray) -> np.ndarray:
        """Image patches of prepared records (plan.Known)."""
        return self.tables[source].patches(positions)

    def window(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(records, lengths) of stream positions [start, start+count): what the planner may use
        (plan.Known). Length -1: not prepared yet."""
        return self.tables[source].window(start, count)

    def _dispatch(self, plan: StepPlan) -> None:
        plan_summary = {
            "rank_costs": plan.rank_costs,
            "max_over_mean": imbalance(plan.rank_costs),
            "naive_rank_costs": plan.naive_rank_costs,
            "naive_max_over_mean": imbalance(plan.naive_rank_costs),
            "source_tokens": {s.name: plan.source_tokens[s.index] for s in self.job.sources},
        }
        if plan.step % 100 == 0:
            log.info("step %d planned: max/mean rank cost %.3f (arrival order: %.3f)", plan.step,
                     plan_summary["max_over_mean"], plan_summary["naive_max_over_mean"])
        t = plan.pieces
        keys = (t[:, SOURCE].astype(np.uint64) << np.uint64(48)) | t[:, RECORD].astype(np.uint64)
        refs = np.column_stack([keys, t[:, OFFSET].astype(np.uint64), t[:, LENGTH].astype(np.uint64)])
        bounds = np.searchsorted(plan.rank, np.arange(self.job.dp + 1))
        items, positions = [], []
        # global ranks; each gets its DP rank's part of the plan (optional metadata-only stages too)
        for rank in sorted(self.receivers | (self.trainers.keys() - self.receivers)):
            d = self.topology.coords(rank).dp
            lo, hi = bounds[d], bounds[d + 1]
            counts = np.bincount(plan.row[lo:hi], minlength=plan.rows_per_rank).astype("<u4")
            header = P.make(P.STEP_HEADER, step=plan.step, rank=rank, row_len=plan.row_capacity, plan=plan_summary)
            self._send(self.trainers[rank].identity, header, np.ascontiguousarray(refs[lo:hi], dtype="<u8"), counts)
            items.append(np.column_stack([np.full(hi - lo, rank, dtype=np.uint64),
                                          np.arange(hi - lo, dtype=np.uint64), refs[lo:hi]]))
            positions.append(t[lo:hi][:, [SOURCE, POSITION]])
        self._send_deliveries(plan.step, np.concatenate(items), np.concatenate(positions), plan.finished)

    def _holders(self, positions: np.ndarray) -> np.ndarray:
        """The worker holding each [source, position] row's prepared copy."""
        owners = np.empty(len(positions), dtype=np.int64)
        for s in np.unique(positions[:, 0]).tolist():
            mask = positions[:, 0] == s
            owners[mask] = self.tables[s].holders(positions[mask, 1])
        if (owners == NOBODY).any():
            missing = positions[owners == NOBODY][0].tolist()
            raise RuntimeError(f"no worker holds source {missing[0]} position {missing[1]}")
        return owners

    def _send_deliveries(self, step: int, items: np.ndarray, positions: np.ndarray, release: np.ndarray) -> None:
        """One DELIVER per worker holding any of the pieces: payloads go worker -> rank directly.
        items: [rank, piece, doc_key, offset, length] rows; positions and release: [source,
        position] rows (of each item's record; of prepared copies used up after this step)."""
        owners, release_owners = self._holders(positions), self._holders(release)
        for wid in np.union1d(owners, release_owners).tolist():
            mask = owners == wid
            mine, mine_pos = items[mask], positions[mask]
            rel = release[release_owners == wid]
            did = self._next_delivery_id
            self._next_delivery_id += 1
            self.deliveries[did] = Delivery(did, wid, step, mine, mine_pos, rel, np.unique(mine[:, 0]).tolist())
            self.workers[wid].deliveries.add(did)
            ranks = np.unique(mine[:, 0]).tolist()
            header = P.make(P.DELIVER, delivery_id=did, step=step,
                            addresses=[[r, self.trainers[r].address] for r in ranks if r in self.trainers])
            release_keys = np.empty(len(rel), dtype="<u8")
            for s in np.unique(rel[:, 0]).tolist():
                mask = rel[:, 0] == s
                release_keys[mask] = (np.uint64(s) << np.uint64(48)) | self.tables[s].records(rel[mask, 1]).astype(
                    np.uint64)
            self._send(self.workers[wid].identity, header, np.ascontiguousarray(mine, dtype="<u8"), release_keys)

    # ------------------------------------------------------------------ resume

    def _reset_tables(self) -> None:
        """Start every source's position table at the first position the plan still needs."""
        st = self.planner.state
        for s, table in enumerate(self.tables):
            carry = st.carry[s]
            table.reset(min(st.cursors[s], carry[0]) if carry is not None else st.cursors[s])

    def _rewind(self, step: int) -> None:
        """Plan again from `step` (a trainer resumes from an older checkpoint). The planner is
        deterministic, so the steps planned again are the ones planned before; what was prepared
        or in flight for them is dropped, and the workers start clean (they register again)."""
        log.warning("rewinding the plan from step %d to step %d", self.planner.state.next_step, step)
        self.planner.state = self.journal.state_before(step)
        self.journal.forget_after(step)
        self.deliveries.clear()
        self.orphans.clear()
        self.acked.clear()
        self.reprepare.clear()
        self.tasks.clear()
        self.waiting = None
        if self.end is not None and self.end[0] > step:
            self.end = None
        for w in list(self.workers.values()):
            self._send(w.identity, P.make(P.UNKNOWN_PEER, reason=f"plan rewound to step {step}: start clean"))
            self.peers.pop(w.identity, None)
        self.workers.clear()
        self._reset_tables()

    # ------------------------------------------------------------------ prepare-ahead

    def _per_step(self, s: int) -> float:
        """Records of source s a step uses, at the current weights and mean record length."""
        step = self.planner.state.next_step
        w = max(self.planner.weights_at(step)[s], self.planner.weights_at(step + self.job.runtime.lookahead_steps)[s])
        if w <= 0:
            return 0.0
        mean_len = self.len_sum[s] / self.len_count[s] if self.len_count[s] else self.job.batch.seq_len / 4
        return w * self.job.step_tokens_at(step) / max(mean_len, 1.0)

    def _task_size(self, s: int) -> int:
        """Records per prepare task: prepare_batch, or fewer for a source a step uses little of
        (with many sources, a full batch each would hold far more prepared data than needed)."""
        return max(1, min(self.job.runtime.prepare_batch, math.ceil(self._per_step(s))))

    def _window(self, s: int) -> int:
        """Records to keep prepared ahead of source s's cursor: enough for the look-ahead steps."""
        per_step = self._per_step(s)
        if per_step <= 0:
            return 0
        return math.ceil((self.job.runtime.lookahead_steps + 1) * per_step) + self._task_size(s)

    def _prepare_ahead(self) -> None:
        if not self.workers:
            return
        for s in range(len(self.job.sources)):
            cursor = self.planner.state.cursors[s]
            batch, window = self._task_size(s), self._window(s)  # fixed while tasks are issued
            while self.tables[s].end - cursor < window and self._left(s):
                self._prepare_next_batch(s, min(batch, self._left(s)))

    def _ensure_prepared(self, s: int, position: int) -> None:
        batch = self._task_size(s)
        while self.tables[s].end <= position and self.workers and self._left(s):
            self._prepare_next_batch(s, min(batch, self._left(s)))

    def _left(self, s: int) -> int:
        """Stream positions of source s not sent to a worker yet (sources with finite epochs end)."""
        limit = self.planner.limit[s]
        return 1 << 62 if limit is None else max(0, limit - self.tables[s].end)

    def _prepare_next_batch(self, s: int, batch: int) -> None:
        records = self.planner.streams[s].records_array(self.tables[s].end, batch)
        self._issue_prepare(s, self.tables[s].issue(records))

    def _issue_prepare(self, s: int, positions: np.ndarray, avoid: int | None = None) -> None:
        retiring = self.workforce.retiring()
        candidates = ([w for w in self.workers.values() if w.worker_id != avoid and w.worker_id not in retiring]
                      or [w for w in self.workers.values() if w.worker_id not in retiring]
                      or list(self.workers.values()))
        if not candidates:
            # No live worker: remember the work; it is re-issued when a worker registers.
            log.warning("no worker to prepare %d records of source %d; waiting", len(positions), s)
            tid = self._next_task_id
            self._next_task_id += 1
            self.tasks[tid] = PrepareTask(tid, s, positions, -1)
            return
        weights = self.planner.weights_at(self.planner.state.next_step)
        if s in self.mapped:
            # Prepared here and now: the lengths come from the index, and the worker that will read
            # the records from its map is the one holding the fewest such records.
            held = np.zeros(self._next_worker_id + 1, dtype=np.int64)
            for m in self.mapped:
                held += self.tables[m].held_counts(len(held))
            worker = self.workforce.choose(s, candidates, weights, held=held)
            records = self.tables[s].records(positions)
            self._set_prepared(s, positions, self.mapped[s].lengths(records), worker.worker_id)
            return
        worker = self.workforce.choose(s, candidates, weights)
        tid = self._next_task_id
        self._next_task_id += 1
        estimate = self.workforce.estimate(s, len(positions))
        self.tasks[tid] = PrepareTask(tid, s, positions, worker.worker_id, estimate)
        worker.tasks.add(tid)
        worker.backlog_s += estimate
        records = self.tables[s].records(positions).astype("<u8")
        self._send(worker.identity, P.make(P.PREPARE, task_id=tid, source=s), records)

    def status(self) -> dict[str, Any]:
        return {
            "time": time.time(),
            "messages_received": self.messages_received,
            "messages_sent": self.messages_sent,
            "next_step": self.planner.state.next_step,
            "consumed": {r: t.consumed for r, t in self.trainers.items()},
            "workers": len(self.workers),
            "tasks_in_flight": len(self.tasks),
            "deliveries_unacked": len(self.deliveries),
            "skipped": {s.name: self.skipped[s.index] for s in self.job.sources},
            **self.workforce.status([s.name for s in self.job.sources],
                                    self.planner.weights_at(self.planner.state.next_step),
                                    self.job.step_tokens_at(self.planner.state.next_step)),
        }


MIXTURE_JOURNAL = "mixture.journal"
JOB_RECORD = "job.json"


class JobChanged(MsdError):
    def __init__(self, state_dir: str, diff: list[str]) -> None:
        self.diff = diff
        super().__init__(f"{state_dir}: the job file changed since this state was written; refusing to continue "
                         "(--allow-config-change to continue anyway):\n" + "\n".join(f"  {d}" for d in diff))


def check_job_change(state_dir: str | None, job: JobConfig, allow: bool) -> bool:
    """Compare the job with the one the state dir was written for, and record the job there.
    A changed topology is an elastic resume (the global stream does not depend on it). Any other
    change raises JobChanged with the differences, unless allowed. Returns whether the stream
    definition changed (and was allowed)."""
    if not state_dir:
        return False
    os.makedirs(state_dir, exist_ok=True)
    path = os.path.join(state_dir, JOB_RECORD)
    current = {"stream": job.stream_definition(), "topology": job.topology._asdict()}
    changed = False
    try:
        with open(path, "rb") as f:
            previous = orjson.loads(f.read())
    except FileNotFoundError:
        previous = None
    if previous is not None:
        diff = config_diff(previous.get("stream"), current["stream"])
        if diff and not allow:
            raise JobChanged(state_dir, diff)
        if diff:
            log.warning("the job changed (allowed by --allow-config-change): %s", "; ".join(diff))
            changed = True
        topo = config_diff(previous.get("topology"), current["topology"], "topology")
        if topo:
            log.warning("elastic resume: %s; the same global stream continues over the new ranks", "; ".join(topo))
    write_json_atomically(path, current)
    return changed


def read_mixture_journal(state_dir: str | None) -> list[tuple[int, list[float]]]:
    """The run-time mixture changes recorded in the state dir, in the order they were made."""
    if not state_dir:
        return []
    path = os.path.join(state_dir, MIXTURE_JOURNAL)
    try:
        with open(path, "rb") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for i, line in enumerate(lines, start=1):
        try:
            entry = orjson.loads(line)
            out.append((int(entry["at_step"]), [float(w) for w in entry["weights"]]))
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            if i == len(lines):  # a write cut short by a crash: it was never acknowledged
                log.warning("%s:%d: incomplete last entry ignored", path, i)
            else:
                raise ValueError(f"{path}:{i}: corrupt journal entry") from None
    return out


def append_mixture_journal(state_dir: str, at_step: int, weights: list[float]) -> None:
    """Append one change durably (fsync) before it is applied and acknowledged."""
    os.makedirs(state_dir, exist_ok=True)
    with open(os.path.join(state_dir, MIXTURE_JOURNAL), "ab") as f:
        f.write(orjson.dumps({"at_step": at_step, "weights": weights}) + b"\n")
        f.flush()
        os.fsync(f.fileno())


def write_json_atomically(path: str, value: Any) -> None:
    """Temp file, fsync, rename: readers see the old or the new content, never a torn one."""
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_state_file(state_dir: str, job: JobConfig, address: str) -> None:
    """Record where this coordinator listens and which job it runs, durably (temp, fsync, rename).
    Tools find the coordinator from here; a restart whose job digest differs is reported."""
    os.makedirs(state_dir, exist_ok=True)
    path = os.path.join(state_dir, "coordinator.json")
    try:
        with open(path, "rb") as f:
            previous = orjson.loads(f.read())
        if previous.get("digest") != job.digest():
            log.warning("%s: the job file changed since the last run (digest %s, now %s)", path,
                        previous.get("digest"), job.digest())
    except (OSError, orjson.JSONDecodeError):
        pass
    record = {"address": address, "digest": job.digest(), "job": os.path.abspath(job.path), "pid": os.getpid(),
              "protocol": P.PROTOCOL_VERSION}
    write_json_atomically(path, record)


def serve(job: JobConfig, sources: OpenedSources, bind: str, state_dir: str | None = None,
          allow_config_change: bool = False) -> None:
    """Run a coordinator until SIGINT/SIGTERM."""
    import signal

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is a core dependency; tolerate its absence on exotic platforms
        pass

    async def main() -> None:
        coord = Coordinator(job, sources, bind, state_dir, allow_config_change)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, coord.stop)
        ready = loop.create_future()
        if state_dir:
            ready.add_done_callback(lambda f: write_state_file(state_dir, job, f.result()))
        await coord.run(ready)
        if coord.failed:
            raise SystemExit(1)

    asyncio.run(main())
