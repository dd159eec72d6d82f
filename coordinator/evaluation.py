"""Evaluation sets: their records, their fixed layout, and serving passes over them.

A set's records are fixed by the job (coordinator/holdout.py: held-out records of training
sources, and every record of sources named for the set, at most `max_records` of each: a fixed
sample). Its layout is a pure function of (job, seed, data, dp): pieces (a record, or a record's
piece of at most the set's `seq_len` where the source is `concat`) laid on dp ranks x M
micro-batches x micro_batch_size rows by the cost model, M the fewest that hold them, so every
rank gets the same number of micro-batches (padding rows where needed) and every token of the
set is in exactly one row. Lengths come from workers, as for training.

A pass is served when a rank asks for it (`eval_request`): the set's records are prepared by
workers (epoch EVAL_EPOCH: cached apart from training's copies), and each rank that asks gets its
recipe (`eval_header`) and its pieces from the workers holding them (`deliver` of step
`eval_step(set, pass)`). Once every registered rank has had the pass, the copies are released
(or, with `prepare_ahead`, kept for the next pass). A worker that dies in a pass loses its
copies: they are prepared again elsewhere and their pieces sent again to the ranks already
served (a client takes each piece once). Nothing here touches the training stream: eval tasks
have ids of their own, and the planner never waits on them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from msd_common import protocol as P
from msd_common.doc_keys import doc_key
from msd_common.topology import Topology

from . import balance
from msd_common.spec import EvalSetConfig, JobConfig
from .holdout import Holdout, sample
from .instructions import Send

log = logging.getLogger("msd.coordinator")

EVAL_TASK_BASE = 1 << 40  # eval prepare tasks' ids: apart from training's TaskBook


@dataclass
class _Task:
    task_id: int
    set_index: int
    indices: np.ndarray  # into the set's records
    worker_id: int


@dataclass
class EvalSet:
    cfg: EvalSetConfig
    sources: np.ndarray  # per record of the set
    records: np.ndarray
    lengths: np.ndarray  # -1: not known yet; 0: skipped (a worker could not read it)
    holder: np.ndarray  # worker holding a prepared copy, -1: none
    layout: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] | None = None  # dp rank -> (refs, counts, record idx)
    layout_dp: int = 0
    current: int = -1  # the pass being served (or the last one)
    served: dict[int, bytes] = field(default_factory=dict)  # rank -> peer, of the current pass
    waiting: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # rank -> (pass, peer) not served yet
    # per worker: rank -> records whose pieces it was asked to send in the current pass (a worker
    # that dies may not have sent them: they are prepared again and sent again)
    delivered_by: dict[int, dict[int, set[int]]] = field(default_factory=dict)
    resend: dict[int, set[int]] = field(default_factory=dict)  # rank -> records to send it again
    released: bool = True  # the current pass's copies are released

    @property
    def tokens(self) -> int:
        return int(self.lengths[self.lengths > 0].sum())


def set_records(job: JobConfig, holdout: Holdout, num_records: list[int], cfg: EvalSetConfig
                ) -> tuple[np.ndarray, np.ndarray]:
    """(source, record) of every record of an eval set, by source then record."""
    sources, records = [], []
    for s, _ in cfg.holdout:
        recs = holdout.records(cfg.index, s)
        if cfg.max_records is not None:
            recs = sample(job.seed, s, recs, cfg.max_records)
        sources.append(np.full(len(recs), s, np.int64))
        records.append(recs)
    for s in cfg.sources:
        recs = np.arange(num_records[s], dtype=np.int64)
        if cfg.max_records is not None:
            recs = sample(job.seed, s, recs, cfg.max_records)
        sources.append(np.full(len(recs), s, np.int64))
        records.append(recs)
    if not sources:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(sources), np.concatenate(records)


def layout(job: JobConfig, cfg: EvalSetConfig, sources: np.ndarray, records: np.ndarray, lengths: np.ndarray,
           dp: int) -> tuple[dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]], int]:
    """Per dp rank: (RECIPE_PIECE refs in packing order, pieces per row, the set's record index of
    each piece); and the micro-batches per rank. Deterministic: a function of its arguments."""
    row_len = cfg.seq_len or job.batch.seq_len
    mbs = job.batch.micro_batch_size
    idx, offs, lens = [], [], []
    for i, (s, n) in enumerate(zip(sources.tolist(), lengths.tolist())):
        if n <= 0:
            continue
        src = job.sources[s]
        if src.whole or src.long_docs in ("truncate", "drop"):
            if n > row_len and src.long_docs == "drop":
                continue
            idx.append(i)
            offs.append(0)
            lens.append(min(n, row_len))
            continue
        for off in range(0, n, row_len):
            idx.append(i)
            offs.append(off)
            lens.append(min(row_len, n - off))
    idx_a, off_a, len_a = (np.asarray(x, dtype=np.int64) for x in (idx, offs, lens))
    cost = balance.Cost(job.cost.quadratic, job.cost.linear)
    micro_batches = max(1, math.ceil(int(len_a.sum()) / (dp * mbs * row_len)))
    while True:
        grid = balance.Grid(dp, micro_batches, mbs, row_len)
        lay, left = balance.whole_layout(len_a, np.ones(len(len_a), bool), grid, cost)
        if not len(left):
            break
        micro_batches += max(1, math.ceil(micro_batches * 0.05))
    rows_per_rank = micro_batches * mbs
    out = {}
    rank_of = lay.row // rows_per_rank
    for d in range(dp):
        mine = np.flatnonzero(rank_of == d)  # in row, then packing order
        pieces = lay.piece[mine]
        refs = np.column_stack([doc_key(sources[idx_a[pieces]], records[idx_a[pieces]]).astype(np.uint64),
                                off_a[pieces].astype(np.uint64), len_a[pieces].astype(np.uint64)]) \
            if len(mine) else np.zeros((0, 3), np.uint64)
        counts = np.bincount(lay.row[mine] % rows_per_rank, minlength=rows_per_rank).astype(np.uint32)
        out[d] = (refs.reshape(-1, 3), counts, idx_a[pieces])
    return out, micro_batches


class EvalBook:
    """Every eval set of the job and the passes being served; the coordinator's state owns one."""

    def __init__(self, job: JobConfig, holdout: Holdout, num_records: list[int], topology: Topology,
                 workers: Callable[[], dict], trainers: Callable[[], dict]) -> None:
        self.job = job
        self.topology = topology
        self._outbox: list[Send] = []  # what the call being answered sends (each entry point returns it)
        self._workers = workers  # worker id -> WorkerInfo (identity)
        self._trainers = trainers  # rank -> TrainerInfo (identity, address)
        self.sets: list[EvalSet] = []
        for cfg in job.eval_sets:
            sources, records = set_records(job, holdout, num_records, cfg)
            n = len(records)
            self.sets.append(EvalSet(cfg, sources, records, np.full(n, -1, np.int64), np.full(n, -1, np.int64)))
        self.by_name = {e.cfg.name: e for e in self.sets}
        self.tasks: dict[int, _Task] = {}
        self._next_task = EVAL_TASK_BASE
        self._rr = 0  # round robin over workers
        self.losses: dict[str, dict[str, tuple[int, float]]] = {}  # set -> source -> (step, mean loss)

    def _send(self, peer: bytes, message: P.Message) -> None:
        self._outbox.append(Send(peer, message))

    def _sends(self) -> list[Send]:
        out, self._outbox = self._outbox, []
        return out

    # ------------------------------------------------------------------ requests

    def request(self, rank: int, name: str, pass_no: int, peer: bytes) -> list[Send]:
        """A rank asks for a pass: what to send (its header and deliveries, prepare tasks)."""
        e = self.by_name.get(name)
        if e is None:
            known = ", ".join(self.by_name) or "none"
            self._refuse(peer, rank, name, pass_no, f"the job has no eval set {name!r} (its eval sets: {known})")
            return self._sends()
        if pass_no > e.current and not e.released and rank not in e.served:
            # a rank past the current pass had it already (from a coordinator before a restart):
            # it counts as served, so that the pass's copies go once the others have had it
            e.served[rank] = peer
        e.waiting[rank] = (pass_no, peer)  # an older pass (a rank that restarted) is served again too
        self._advance(e)
        return self._sends()

    def _refuse(self, peer: bytes, rank: int, name: str, pass_no: int, reason: str) -> None:
        self._send(peer, P.EvalHeader(set=name, pass_no=pass_no, rank=rank, step=0, row_len=1, reason=reason,
                                      pieces=np.zeros((0, 3), np.uint64), counts=np.zeros(0, np.uint32)))

    def _advance(self, e: EvalSet) -> None:
        """Start the next pass asked for once the current one is done, prepare what it needs, and
        serve the ranks waiting for it when its records are all held."""
        if e.waiting and (e.released or not e.served) and not e.resend:
            nxt = min(p for p, _ in e.waiting.values())
            if nxt != e.current or e.released:
                e.current, e.served, e.delivered_by = nxt, {}, {}
                e.released = False
        needed = self._needed(e)
        self._prepare(e, needed)
        if self._held(e, needed):
            self._serve_waiting(e)
        # (whether or not anything was served now: every rank may have had the pass by now, the last
        # one before a relay or a rank came back; until issue 58 only a pass served in this call was
        # released, and ranks waiting for the next pass waited for good: found by msd.sim)
        if self._maybe_release(e) and e.waiting:
            self._advance(e)  # the next pass some rank waits for

    def _serve_waiting(self, e: EvalSet) -> None:
        dp = self.topology.dp
        if e.layout is None or e.layout_dp != dp:
            e.layout, micro_batches = layout(self.job, e.cfg, e.sources, e.records, e.lengths, dp)
            e.layout_dp = dp
            log.info("eval set %s: %d records, %d tokens, %d micro-batches per rank", e.cfg.name, len(e.records),
                     e.tokens, micro_batches)
        if not e.released:
            for rank, (pass_no, peer) in sorted(e.waiting.items()):
                if pass_no != e.current:
                    continue
                del e.waiting[rank]
                self._serve(e, rank, peer)
        for rank, records in sorted(e.resend.items()):
            self._deliver(e, rank, only=records)
        e.resend = {}

    def _needed(self, e: EvalSet) -> np.ndarray:
        """Which of the set's records must be held now: all of them while a rank waits for the
        current pass (their lengths fix the layout), else those some rank must be sent again."""
        if any(p == e.current for p, _ in e.waiting.values()) or (e.waiting and e.released):
            return np.ones(len(e.records), bool)
        need = np.zeros(len(e.records), bool)
        for records in e.resend.values():
            need[list(records)] = True
        return need

    def _held(self, e: EvalSet, needed: np.ndarray) -> bool:
        if not len(e.records):  # an empty set (a share too small for its source): a pass of padding
            return bool(e.waiting)
        if not needed.any():
            return False
        return bool((e.lengths[needed] >= 0).all() and (e.holder[needed & (e.lengths > 0)] >= 0).all())

    def _serve(self, e: EvalSet, rank: int, peer: bytes) -> None:
        d = self.topology.coords(rank).dp
        refs, counts, _ = e.layout[d]
        step = P.eval_step(e.cfg.index, e.current)
        self._send(peer, P.EvalHeader(set=e.cfg.name, pass_no=e.current, rank=rank, step=step,
                                      row_len=e.cfg.seq_len or self.job.batch.seq_len, reason="", pieces=refs,
                                      counts=counts))
        e.served[rank] = peer
        self._deliver(e, rank)

    def _deliver(self, e: EvalSet, rank: int, only: set[int] | None = None) -> None:
        """One `deliver` per worker holding pieces of this rank's rows (those of records in `only`)."""
        trainer = self._trainers().get(rank)
        if trainer is None:
            return
        d = self.topology.coords(rank).dp
        refs, _, rec_idx = e.layout[d]
        pieces = np.arange(len(refs))
        if only is not None:
            pieces = pieces[np.isin(rec_idx, np.fromiter(only, np.int64, len(only)))]
        holders = e.holder[rec_idx[pieces]]
        workers = self._workers()
        for wid in np.unique(holders).tolist():
            w = workers.get(wid)
            if w is None:
                continue
            mine = pieces[holders == wid]
            e.delivered_by.setdefault(wid, {}).setdefault(rank, set()).update(rec_idx[mine].tolist())
            items = np.column_stack([np.full(len(mine), rank, np.uint64), mine.astype(np.uint64), refs[mine]])
            self._send(w.identity, P.Deliver(
                worker_id=w.worker_id, delivery_id=0, step=P.eval_step(e.cfg.index, e.current),
                addresses=[trainer.address], items=items, release=np.zeros(0, np.uint64),
                epochs=np.full(len(mine), P.EVAL_EPOCH, np.uint32), release_epochs=np.zeros(0, np.uint32),
                targets=np.array([[rank, 0]], np.uint64)))

    def _maybe_release(self, e: EvalSet) -> bool:
        """Once every registered rank has had the pass, the copies go (unless prepare_ahead). True
        when the pass was released now."""
        if e.released or not e.served or e.resend or any(r not in e.served for r in self._trainers()):
            return False
        e.released = True
        if not e.cfg.prepare_ahead:  # (with it the copies are kept: the next pass is served from them at once)
            self._release_all(e)
        return True

    def _release_all(self, e: EvalSet) -> None:
        workers = self._workers()
        for wid in np.unique(e.holder[e.holder >= 0]).tolist():
            w = workers.get(wid)
            mine = np.flatnonzero(e.holder == wid)
            if w is not None:
                keys = doc_key(e.sources[mine], e.records[mine]).astype(np.uint64)
                self._send(w.identity, P.Deliver(
                    worker_id=w.worker_id, delivery_id=0, step=P.eval_step(e.cfg.index, e.current), addresses=[],
                    items=np.zeros((0, 5), np.uint64), release=keys, epochs=np.zeros(0, np.uint32),
                    release_epochs=np.full(len(mine), P.EVAL_EPOCH, np.uint32), targets=np.zeros((0, 2), np.uint64)))
            e.holder[mine] = -1

    # ------------------------------------------------------------------ preparing

    def _prepare(self, e: EvalSet, needed: np.ndarray) -> None:
        """Prepare tasks for the needed records that are neither held nor in a task (known
        skipped records need nothing)."""
        if not needed.any():
            return
        busy = np.zeros(len(e.records), bool)
        for t in self.tasks.values():
            if self.sets[t.set_index] is e:
                busy[t.indices] = True
        need = np.flatnonzero(needed & (e.holder < 0) & (e.lengths != 0) & ~busy)
        workers = sorted(self._workers())
        if not len(need) or not workers:
            return
        batch = self.job.runtime.prepare_batch
        for s in np.unique(e.sources[need]).tolist():
            mine = need[e.sources[need] == s]
            for lo in range(0, len(mine), batch):
                self._issue(e, mine[lo: lo + batch], workers)

    def _issue(self, e: EvalSet, indices: np.ndarray, workers: list[int]) -> None:
        wid = workers[self._rr % len(workers)]
        self._rr += 1
        task = _Task(self._next_task, self.sets.index(e), indices, wid)
        self._next_task += 1
        self.tasks[task.task_id] = task
        s = int(e.sources[indices[0]])
        self._send(self._workers()[wid].identity, P.Prepare(
            task_id=task.task_id, source=s, worker_id=wid, records=e.records[indices].astype(np.uint64),
            epochs=np.full(len(indices), P.EVAL_EPOCH, np.uint32)))

    def owns(self, task_id: int) -> bool:
        return task_id >= EVAL_TASK_BASE

    def prepared(self, task_id: int, worker_id: int, lengths: np.ndarray) -> list[Send]:
        task = self.tasks.get(task_id)
        if task is None or task.worker_id != worker_id or len(lengths) != len(task.indices):
            return []
        del self.tasks[task_id]
        e = self.sets[task.set_index]
        known = e.lengths[task.indices]
        lengths = np.asarray(lengths, dtype=np.int64)
        if ((known >= 0) & (known != lengths)).any():
            log.error("eval set %s: a record's length changed between passes (a transform that is not "
                      "deterministic?); the layout keeps the first", e.cfg.name)
        e.lengths[task.indices] = np.where(known >= 0, known, lengths)
        e.holder[task.indices[lengths > 0]] = worker_id
        self._advance(e)
        return self._sends()

    def failed(self, task_id: int) -> list[Send]:
        task = self.tasks.pop(task_id, None)
        if task is not None:
            self._advance(self.sets[task.set_index])
        return self._sends()

    def worker_gone(self, worker_id: int) -> list[Send]:
        self._forget_workers(lambda held_by: held_by == worker_id)
        return self._sends()

    def reset(self) -> list[Send]:
        """Every worker starts clean (a rewind): no copy is held any more."""
        self._forget_workers(lambda held_by: held_by >= 0)
        return self._sends()

    def _forget_workers(self, gone: Callable[[Any], Any]) -> None:
        """The copies the workers `gone` marks are lost: their tasks are dropped, their records are
        prepared again if a pass needs them, and what they were asked to send in the current pass,
        which may never have gone, is sent again from new copies."""
        for t in [t for t in self.tasks.values() if gone(t.worker_id)]:
            del self.tasks[t.task_id]
        for e in self.sets:
            e.holder[gone(e.holder)] = -1
            for wid in [w for w in e.delivered_by if gone(w)]:
                for rank, records in e.delivered_by.pop(wid).items():
                    if rank in self._trainers():
                        e.resend.setdefault(rank, set()).update(records)
            if e.resend:
                e.released = False
            self._advance(e)

    def pump(self) -> list[Send]:
        """Workers came (or were waited for): carry on with what is waiting."""
        for e in self.sets:
            if e.waiting or e.resend or (e.served and not e.released):
                self._advance(e)
        return self._sends()

    # ------------------------------------------------------------------ reports

    def report(self, name: str, step: int, losses: Any, rank: int = -1) -> dict[str, float] | None:
        """A rank's mean loss per source: kept for status and metrics (and logged); None if unusable."""
        if name not in self.by_name or not isinstance(losses, dict):
            log.warning("rank %d: eval report for set %r dropped (unknown set, or losses not a mapping of "
                        "source -> number)", rank, name)
            return None
        clean = {str(k): float(v) for k, v in losses.items()
                 if isinstance(v, (int, float)) and math.isfinite(float(v))}
        mine = self.losses.setdefault(name, {})
        for source, loss in clean.items():
            mine[source] = (step, loss)
        log.info("eval %s at step %d (rank %d): %s", name, step, rank,
                 ", ".join(f"{k} {v:.4f}" for k, v in sorted(clean.items())))
        return clean

    def status(self) -> dict[str, Any]:
        return {e.cfg.name: {"records": len(e.records), "tokens_known": e.tokens,
                             "lengths_known": int((e.lengths >= 0).sum()), "pass": e.current,
                             "served": sorted(e.served), "released": e.released,
                             "loss": {s: {"step": st, "loss": v} for s, (st, v) in self.losses.get(e.cfg.name,
                                                                                                {}).items()}}
                for e in self.sets}
