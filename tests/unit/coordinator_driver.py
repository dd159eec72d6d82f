"""Drives a CoordinatorState with scripted events, no processes and no sockets: in-process stand-ins
for workers (they read real records with the real readers, keep a cache of copies as a worker
does, and can die), trainer ranks (they consume a step once all of its pieces are in) and the
clock. Every Send the state returns is answered the way the real peer would answer it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from msd_common.spec import JobConfig
from coordinator.events import (Consumed, Delivered, Event, HostHeartbeat, HostHello, Prepared, Tick, TrainerBye,
                                TrainerHeartbeat,
                                TrainerHello, WorkerExited, WorkerHeartbeat, WorkerHello)
from coordinator.history import StepHistory
from coordinator.instructions import Instruction, Send
from coordinator.sources import open_sources
from coordinator.state import CoordinatorState
from msd_common import protocol as P
from msd_common.doc_keys import doc_key, split_doc_key
from msd_common.protocol import DELIVER_ITEM
from worker.samples import open_source


@dataclass
class FakeWorker:
    peer: bytes
    worker_id: int | None = None
    alive: bool = True
    cache: dict[int, int] = field(default_factory=dict)  # doc key -> prepared copies
    busy_s: float = 0.0
    pid: int = 0
    # busy on one long sample until then: it reads nothing and says nothing; what comes for it waits
    # in its socket (inbox) and is read in order once it is done
    busy_until: float = float("-inf")
    inbox: list = field(default_factory=list)


@dataclass
class FakeRank:
    rank: int
    peer: bytes
    consumed: int = -1
    headers: dict[int, np.ndarray] = field(default_factory=dict)  # step -> recipe (RECIPE_PIECE rows)
    arrived: dict[int, set[int]] = field(default_factory=dict)  # step -> recipe indices received
    waited_s: float = 0.0


class Driver:
    def __init__(self, job: JobConfig, history: StepHistory | None = None,
                 quarantined: list[tuple[str, int]] = ()) -> None:
        self.job = job
        self.sources = open_sources(job)
        self.state = CoordinatorState(job, self.sources, history or StepHistory(False), (), quarantined)
        self.readers = [open_source(spec) for spec in job.worker_job().sources]
        self.now = 0.0
        self.workers: dict[bytes, FakeWorker] = {}
        self.ranks: dict[int, FakeRank] = {}
        self.pending: list[Event] = []
        self.out: list[Instruction] = []  # every instruction, in order
        self.unserved: list[str] = []  # pieces a worker was asked for and could not serve
        self.on_deliver = None  # hook(driver, worker, instruction) -> "drop" | "ack-then-die" | None
        # (source, record) whose reading kills the process; its host agent reports the task and
        # starts a new process (needs add_host)
        self.poison: set[tuple[int, int]] = set()
        self.deaths: list[tuple[int, int]] = []  # (worker id, task id) of every such death
        self.host_peer: bytes | None = None
        self.array_bytes = None  # (source, record) -> the bytes a worker reports beside its tokens (images)
        self.hold_consumed = False  # ranks receive, but train on nothing (steps pile up ahead)
        # source -> mean loss per token a rank reports (DataClient.report_loss) for the step before the
        # one it consumes, over that step's pieces; None: ranks report no loss
        self.loss_of = None

    # ------------------------------------------------------------------ peers

    def add_worker(self, name: str) -> bytes:
        peer = name.encode()
        pid = 1000 + len(self.workers)
        self.workers[peer] = FakeWorker(peer, pid=pid)
        self.pending.append(WorkerHello(at=self.now, peer=peer, version=P.PROTOCOL_VERSION, host="test", pid=pid,
                                        incarnation=pid, agent=1))
        return peer

    def add_host(self) -> bytes:
        """The host agent (agent id 1) that started the workers."""
        self.host_peer = b"host"
        self.pending.append(HostHello(at=self.now, peer=self.host_peer, version=P.PROTOCOL_VERSION, agent_id=1,
                                      host="test", procs=len(self.workers), min_procs=1, max_procs=8, auto=0))
        return self.host_peer

    def add_rank(self, rank: int, resume_step: int = 0, name: str | None = None, carried: dict | None = None) -> bytes:
        peer = (name or f"rank{rank}").encode()
        self.ranks[rank] = FakeRank(rank, peer, consumed=resume_step - 1)
        self.pending.append(TrainerHello(at=self.now, peer=peer, version=P.PROTOCOL_VERSION, rank=rank,
                                         data_address=f"tcp://rank{rank}", resume_step=resume_step, incarnation=rank,
                                         metadata_only=0, carried=carried))
        return peer

    def remove_rank(self, rank: int) -> None:
        r = self.ranks.pop(rank)
        self.pending.append(TrainerBye(at=self.now, peer=r.peer, rank=rank))

    def kill(self, peer: bytes) -> None:
        """The worker process dies: it answers nothing from now on and its cache is gone."""
        self.workers[peer].alive = False
        self.workers[peer].cache.clear()

    # ------------------------------------------------------------------ the loop

    def handle(self, *events: Event) -> list[Instruction]:
        out = self.state.handle(*events)
        self.out.extend(out)
        for ins in out:
            if isinstance(ins, Send):
                self._answer(ins)
        return out

    def flush(self) -> list[Instruction]:
        events, self.pending = self.pending, []
        return self.handle(*events)

    def tick(self, seconds: float | None = None) -> list[Instruction]:
        """Time passes; live peers heartbeat as they do."""
        self.now += self.state.heartbeat_s if seconds is None else seconds
        for w in self.workers.values():  # done with their long sample: they read what waited for them
            if w.alive and w.inbox and w.busy_until <= self.now:
                waiting, w.inbox = w.inbox, []
                for ins in waiting:
                    self._answer(ins)
        beats: list[Event] = [WorkerHeartbeat(at=self.now, peer=w.peer, worker_id=w.worker_id, cached_records=len(
            w.cache), busy_s=w.busy_s) for w in self.workers.values()
            if w.alive and w.worker_id is not None and w.busy_until <= self.now]
        beats += [TrainerHeartbeat(at=self.now, peer=r.peer, rank=r.rank) for r in self.ranks.values()]
        if self.host_peer is not None:
            beats.append(HostHeartbeat(at=self.now, peer=self.host_peer, agent_id=1, procs=len(self.workers),
                                       pids=[w.pid for w in self.workers.values()
                                             if w.alive and w.busy_until > self.now]))
        events, self.pending = self.pending, []
        return self.handle(*events, *beats, Tick(at=self.now))

    def run(self, steps: int, max_rounds: int = 10_000) -> None:
        """Until every rank has consumed steps 0..steps-1."""
        for _ in range(max_rounds):
            if self.ranks and min(r.consumed for r in self.ranks.values()) >= steps - 1:
                return
            self._consume()
            if self.pending:
                self.flush()
            else:
                self.tick()
        raise AssertionError(f"not done in {max_rounds} rounds: ranks consumed "
                             f"{ {r.rank: r.consumed for r in self.ranks.values()} }")

    def _consume(self) -> None:
        if self.hold_consumed:
            return
        for r in self.ranks.values():
            step = r.consumed + 1
            recipe = r.headers.get(step)
            if recipe is not None and len(r.arrived.get(step, ())) == len(recipe):
                r.consumed = step
                self.pending.append(Consumed(at=self.now, peer=r.peer, rank=r.rank, step=step, waited_s=r.waited_s,
                                             **self._losses(r, step - 1)))

    def _losses(self, r: FakeRank, step: int) -> dict:
        """The losses a rank reports with its `consumed` (of the step before)."""
        recipe = r.headers.get(step)
        if self.loss_of is None or recipe is None:
            return {}
        sources = split_doc_key(recipe[:, 0])[0].astype(np.int64)
        lengths = recipe[:, 2].astype(np.int64)
        mine = sorted(set(sources.tolist()))
        tokens = [int(lengths[sources == s].sum()) for s in mine]
        return {"loss_step": step, "loss_sources": mine, "loss_tokens": tokens,
                "loss_sums": [self.loss_of(s) * n for s, n in zip(mine, tokens)]}

    # ------------------------------------------------------------------ what peers do with messages

    def _answer(self, ins: Send) -> None:
        kind = ins.message.TYPE
        worker = self.workers.get(ins.peer)
        if worker is not None:
            if not worker.alive:
                return
            if worker.busy_until > self.now or worker.inbox:
                worker.inbox.append(ins)
                return
            if kind in ("prepare", "deliver") and (worker.worker_id is None or
                                                   ins.message.worker_id != worker.worker_id):
                return  # not registered, or for an earlier registration: dropped, as WorkerCore does
            if kind == "welcome":
                worker.worker_id = ins.message.worker_id
            elif kind == "unknown_peer":
                worker.worker_id = None
                worker.cache.clear()
                self.pending.append(WorkerHello(at=self.now, peer=worker.peer, version=P.PROTOCOL_VERSION,
                                                host="test", pid=worker.pid, incarnation=worker.pid, agent=1))
            elif kind == "prepare":
                self._prepare(worker, ins)
            elif kind == "deliver":
                self._deliver(worker, ins)
            return
        rank = next((r for r in self.ranks.values() if r.peer == ins.peer), None)
        if rank is not None and kind == "step_header":
            rank.headers.setdefault(ins.message.step, np.asarray(ins.message.pieces))

    def _prepare(self, worker: FakeWorker, ins: Send) -> None:
        s, records = ins.message.source, np.asarray(ins.message.records)
        if any((s, r) in self.poison for r in records.tolist()):  # the process dies on it
            self.kill(worker.peer)
            self.deaths.append((worker.worker_id, ins.message.task_id))
            self.pending.append(WorkerExited(at=self.now, peer=self.host_peer, agent_id=1, pid=worker.pid, exitcode=-9,
                                             task_id=ins.message.task_id))
            self.add_worker(f"{worker.peer.decode()}+")  # the agent starts another process
            return
        lengths = np.zeros(len(records), dtype=np.int64)
        nbytes = np.zeros(len(records) if self.array_bytes is not None else 0, dtype=np.int64)
        skipped = []
        for i, rec in enumerate(records.tolist()):
            if self.array_bytes is not None:
                nbytes[i] = self.array_bytes(s, rec)
            try:
                tokens, _ = self.readers[s].read_sample(rec)
            except Exception as e:  # the real worker's skip
                skipped.append([i, str(e), "corrupt"])
                continue
            key = doc_key(s, rec)
            worker.cache[key] = worker.cache.get(key, 0) + 1
            lengths[i] = len(tokens)
        worker.busy_s += 0.001 * len(records)
        self.pending.append(Prepared(at=self.now, peer=worker.peer, worker_id=worker.worker_id,
                                     task_id=ins.message.task_id, skipped=skipped, busy_s=0.001 * len(records),
                                     lengths=lengths, patches=np.zeros(0, dtype=np.int64), array_bytes=nbytes))

    def _deliver(self, worker: FakeWorker, ins: Send) -> None:
        items, release = np.asarray(ins.message.items), np.asarray(ins.message.release)
        fate = self.on_deliver(self, worker, ins) if self.on_deliver is not None else None
        if fate == "drop":  # dies before sending anything or acknowledging
            self.kill(worker.peer)
            return
        unserved = 0
        if fate != "ack-then-die":
            for row in items.tolist():
                key = row[DELIVER_ITEM.doc_key]
                source = split_doc_key(key)[0]
                if source not in self.state.mapped and not worker.cache.get(key):
                    self.unserved.append(f"worker {worker.worker_id}: step {ins.message.step} key {key:x}")
                    unserved += 1
                    continue
                rank = self.ranks.get(row[DELIVER_ITEM.rank])
                if rank is not None:
                    rank.arrived.setdefault(ins.message.step, set()).add(row[DELIVER_ITEM.piece])
            for key in release.tolist():
                if worker.cache.get(key):
                    worker.cache[key] -= 1
        self.pending.append(Delivered(at=self.now, peer=worker.peer, worker_id=worker.worker_id,
                                      delivery_id=ins.message.delivery_id, unserved=unserved))
        if fate == "ack-then-die":  # acknowledged, but the pieces never left its socket
            self.kill(worker.peer)

    # ------------------------------------------------------------------ what to assert on

    def stream(self, steps: int | None = None) -> dict[tuple[int, int], list]:
        """(rank, step) -> the recipe it received (what determinism promises)."""
        return {(r.rank, k): v.tolist() for r in self.ranks.values() for k, v in r.headers.items()
                if steps is None or k < steps}

    def sends(self, out: list[Instruction], kind: str) -> list[Send]:
        return [i for i in out if isinstance(i, Send) and i.message.TYPE == kind]
