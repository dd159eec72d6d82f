"""Preparation: which records are prepared, on which worker, and when (refills ahead of the plan).

CoordinatorState keeps the decisions of the job (the plan, the registry, quarantine and blame);
this book owns what is known of each stream position (PositionTables: record, length, holder)
and keeps it filled ahead of the planner: prepare tasks to workers (TaskBook), memory-mapped
sources prepared from their index here, held-out and quarantined records settled as length 0
without a worker. PreparePolicy says how much and in what sizes. The book opens no files: the
memory-mapped sources' indexes come in opened (OpenedSources.mapped, read-only views).

It is also the planner's view of the streams (plan.Known: window, patches).
"""

from __future__ import annotations

import logging
from typing import Callable

import numpy as np

from msd_common import protocol as P
from msd_common.formats.storage import is_url
from msd_common.spec import JobConfig

from .lead import PrepareLead
from .plan import Planner
from .positions import HeldCounts, PositionTables
from .prepare_policy import PreparePolicy
from .instructions import Send
from .registry import Registry
from .skips import SkipBook
from .sources import OpenedSources, mapped_lengths
from .tasks import TaskBook
from .workforce import Workforce

log = logging.getLogger("msd.coordinator")


class PreparationBook:
    def __init__(self, job: JobConfig, planner: Planner, sources: OpenedSources, tasks: TaskBook, registry: Registry,
                 workforce: Workforce, lead: PrepareLead, quarantined: dict[int, set[int]], skips: SkipBook,
                 epochs: Callable[[int, np.ndarray], np.ndarray], now: Callable[[], float]) -> None:
        """quarantined: source -> records never handed to a worker (the state's, shared); skips:
        where skips are counted; epochs, now: queries of the state (the pass over a source of each
        position, the time of the event being handled). What to send is returned (a list of
        `Send`), never sent from here."""
        self.job, self.planner, self.tasks, self.registry = job, planner, tasks, registry
        self.workforce, self.lead, self.quarantined, self.skips = workforce, lead, quarantined, skips
        self.epochs, self.now = epochs, now
        n = len(job.sources)
        # Memory-mapped sources: their lengths are in an index the coordinator opened at start-up,
        # so their records need no prepare round trip (a worker reads them straight from the map).
        self.mapped = sources.mapped
        self.mapped_held = HeldCounts()  # copies of memory-mapped records each worker holds
        # per source: record, length, holder by position
        self.tables = PositionTables([self.mapped_held if s in self.mapped else None for s in range(n)])
        self.mapped_mask = np.array([s in self.mapped for s in range(n)], dtype=bool)
        # sources in object storage: their tasks are always full too, so that a worker fetches a
        # task's records in one round of concurrent requests, not a round trip per step's few
        full_tasks = self.mapped_mask | np.array([any(is_url(f) for f in src.files) for src in job.sources], dtype=bool)
        # a source shuffled in blocks gets tasks of whole blocks, each read in one request
        task_block = np.array([src.shuffle_block for src in job.sources], dtype=np.int64)
        self.policy = PreparePolicy(job, full_tasks, task_block, lead)
        self.prepared_stamp = 0  # lengths reported so far (prepare-ahead depends on their mean)
        self.tables_stamp = 0  # resets of the position tables
        self._ahead_stamp: tuple | None = None
        self.len_sum = [0] * n
        self.len_count = [0] * n
        # per source: records longer than seq_len truncated or dropped (long_docs), as prepared
        self.long_docs: list[dict[str, int]] = [{} for _ in range(n)]
        self.reprepare: set[tuple[int, int]] = set()  # (source, position) lost with a dead worker
        self.reprepared = 0  # records prepared again so far (lost with a dead worker)

    def reset_tables(self) -> None:
        """Start every source's position table at the first position the plan still needs."""
        st = self.planner.state
        self.tables_stamp += 1
        for s, table in enumerate(self.tables):
            carry = st.carry[s]
            start = min(st.cursors[s], carry[0]) if carry is not None else st.cursors[s]
            if st.deferred[s]:
                start = min(start, st.deferred[s][0][0])
            table.reset(start)

    def records_per_step(self) -> np.ndarray:
        step = self.planner.state.next_step
        return self.policy.records_per_step(step, self.planner.weights_at(step),
                                            self.planner.weights_at(step + self.job.runtime.lookahead_steps),
                                            self.len_sum, self.len_count)

    def left(self, s: int) -> int:
        """Stream positions of source s not sent to a worker yet (sources with finite epochs end)."""
        limit = self.planner.limit[s]
        return 1 << 62 if limit is None else max(0, limit - self.tables[s].end)

    def prepare_ahead(self) -> list[Send]:
        if not self.registry.workers:
            return []
        # Called on every planning pass (many per step at hundreds of ranks); what it computes
        # changes only with these, so an unchanged stamp means there is nothing to refill.
        stamp = (self.planner.state.next_step, self.prepared_stamp, self.tables_stamp, self.lead.version,
                 len(self.registry.workers), self.registry.next_worker_id, len(self.planner.overrides),
                 tuple(self.planner.state.exhausted))
        if stamp == self._ahead_stamp:
            return []
        self._ahead_stamp = stamp
        per_step = self.records_per_step()
        task = self.policy.task_sizes(per_step)
        window = self.policy.windows(per_step, task)
        ahead = np.fromiter((t.end for t in self.tables), dtype=np.int64, count=len(self.tables)) \
            - np.asarray(self.planner.state.cursors, dtype=np.int64)
        out: list[Send] = []
        for s in self.policy.short(per_step, task, window, ahead).tolist():
            out += self._refill(s, int(task[s]), int(window[s]))
        return out

    def _refill(self, s: int, batch: int, window: int) -> list[Send]:
        table, cursors = self.tables[s], self.planner.state.cursors
        if s in self.mapped:
            self._prepare_mapped(s, cursors[s] + window, batch)
            return []
        out: list[Send] = []
        while table.end - cursors[s] < window and self.left(s):
            out += self._prepare_next_batch(s, min(batch, self.left(s)))
        return out

    def ensure_prepared(self, s: int, position: int) -> list[Send]:
        batch = int(self.policy.task_sizes(self.records_per_step())[s])
        if s in self.mapped and self.registry.workers:
            self._prepare_mapped(s, position + 1, batch)
        out: list[Send] = []
        while self.tables[s].end <= position and self.registry.workers and self.left(s):
            out += self._prepare_next_batch(s, min(batch, self.left(s)))
        return out

    def _prepare_next_batch(self, s: int, batch: int) -> list[Send]:
        records = self.planner.streams[s].records_array(self.tables[s].end, batch)
        return self.issue(s, self.tables[s].issue(records))

    def _prepare_mapped(self, s: int, until: int, batch: int) -> None:
        """A memory-mapped source's positions up to `until` (exclusive; the shortfall rounded up
        to whole tasks of `batch`), prepared here in one pass (their lengths come from the index)
        and dealt to workers in prepare_batch chunks, each chunk to the worker a task of it would
        go to (workforce.choose: least work queued, then fewest such records held). One pass
        instead of a task per chunk: at a thousand ranks a step needs thousands of records, and
        sixty small tasks a step were a sixth of the coordinator's CPU."""
        short = until - self.tables[s].end
        count = min(-(-short // batch) * batch, self.left(s))
        if count <= 0:
            return
        workers = self.registry.workers
        retiring = self.workforce.retiring(self.registry.hosts)
        candidates = [w for w in workers if w not in retiring] or list(workers)
        records = self.planner.streams[s].records_array(self.tables[s].end, count)
        positions = self.tables[s].issue(records)
        lengths = np.zeros(len(records), dtype=np.int64)
        good = np.ones(len(records), dtype=bool)
        if s in self.quarantined:
            good = ~self.is_quarantined(s, records)
            if not good.all():
                self.skips.count(s, "quarantined", int((~good).sum()))
        lengths[good] = self._mapped_lengths(s, records[good])
        weights = self.planner.weights_at(self.planner.state.next_step)
        held = self.mapped_held.counts(self.registry.next_worker_id + 1)
        batch = self.job.runtime.prepare_batch
        holders = np.empty(len(records), dtype=np.int64)
        for lo in range(0, len(records), batch):
            wid = self.workforce.choose(s, candidates, weights, self.tasks.backlog_s, held=held)
            holders[lo:lo + batch] = wid
            held[wid] += min(batch, len(records) - lo)
        self.set_prepared(s, positions, lengths, holders)

    def issue(self, s: int, positions: np.ndarray) -> list[Send]:
        self.tasks.new(s, positions)
        return self.assign_queued()

    def assign_queued(self) -> list[Send]:
        """Hand every queued task to a worker (the allocation picks which), if any is alive: the
        `prepare` messages to send."""
        workers = self.registry.workers
        queued = self.tasks.queued()
        out: list[Send] = []
        if not workers:
            for task in queued:  # remembered: assigned when a worker registers
                self.tasks.requeue(task)
            if queued:  # one line, not one per task: with hundreds of sources there are thousands
                log.warning("no worker to prepare %d records (%d tasks, %d sources); waiting",
                            sum(len(t.positions) for t in queued), len(queued), len({t.source for t in queued}))
            return out
        retiring = self.workforce.retiring(self.registry.hosts)
        weights = self.planner.weights_at(self.planner.state.next_step)
        for task in queued:
            candidates = ([w for w in workers if w != task.avoid and w not in retiring]
                          or [w for w in workers if w not in retiring] or list(workers))
            s = task.source
            # (memory-mapped sources are prepared from their index below; the planner passes over
            # their held-out records all the same)
            if s not in self.mapped and self.planner.holdout.any(s) and self._settle_held_out(task, candidates[0]):
                continue
            if s in self.quarantined and self._settle_quarantined(task, candidates[0]):
                continue
            if s in self.mapped:
                # Prepared here and now: the lengths come from the index, and the worker that will
                # read the records from its map is the one holding the fewest such records.
                held = self.mapped_held.counts(self.registry.next_worker_id + 1)
                wid = self.workforce.choose(s, candidates, weights, self.tasks.backlog_s, held=held)
                self.tasks.assign(task, wid, 0.0, self.now())
                self.tasks.complete(task.task_id, wid)
                records = self.tables[s].records(task.positions)
                self.set_prepared(s, task.positions, self._mapped_lengths(s, records), wid)
                continue
            wid = self.workforce.choose(s, candidates, weights, self.tasks.backlog_s)
            self.tasks.assign(task, wid, self.workforce.estimate(s, len(task.positions)), self.now())
            records = self.tables[s].records(task.positions)
            out.append(Send(workers[wid].identity, P.Prepare(task_id=task.task_id, source=s, worker_id=wid,
                                                             records=records, epochs=self.epochs(s, task.positions))))
        return out

    def _settle_held_out(self, task, worker_id: int) -> bool:
        """Records of a queued task that an eval set holds out of training are prepared as
        length 0 right here: the planner passes over them, so no worker reads them for training
        (an eval pass reads them for itself). True when nothing of the task is left to do."""
        return self._settle(task, worker_id, self.planner.holdout.held_out)

    def _settle_quarantined(self, task, worker_id: int) -> bool:
        """Quarantined records of a queued task are prepared as skipped (length 0) right here, held
        by worker_id, and never handed to a worker; True when nothing of the task is left to do."""
        return self._settle(task, worker_id, self.is_quarantined, skip_kind="quarantined")

    def _settle(self, task, worker_id: int, settled: Callable[[int, np.ndarray], np.ndarray],
                skip_kind: str | None = None) -> bool:
        """The task's records that `settled(source, records)` marks are prepared as length 0, held by
        worker_id (counted as skips of skip_kind, if given); True when nothing of the task is left."""
        s = task.source
        done = settled(s, self.tables[s].records(task.positions))
        if not done.any():
            return False
        if skip_kind:
            self.skips.count(s, skip_kind, int(done.sum()))
        self.set_prepared(s, task.positions[done], np.zeros(int(done.sum()), dtype=np.int64), worker_id,
                          measured=False)
        task.positions = task.positions[~done]
        if len(task.positions):
            return False
        self.tasks.drop(task)
        return True

    def is_quarantined(self, s: int, records: np.ndarray) -> np.ndarray:
        return np.isin(records, np.fromiter(self.quarantined[s], dtype=np.int64))

    def _mapped_lengths(self, s: int, records: np.ndarray) -> np.ndarray:
        """Lengths of memory-mapped records from their index; a record over max_record_bytes is
        skipped (length 0), as a worker would skip it."""
        source = self.job.sources[s]
        lengths, over = mapped_lengths(self.mapped[s], source, records)
        if over.any():
            for r in records[over].tolist():
                log.warning("source %s: record skipped (over_limit): %s: over max_record_bytes (%d)",
                            source.name, self.mapped[s].where(r), source.max_record_bytes,
                            extra={"source": source.name})
            self.skips.count(s, "over_limit", int(over.sum()))
        return lengths

    def set_prepared(self, s: int, positions: np.ndarray, lengths: np.ndarray, worker_id: int | np.ndarray,
                      patches: np.ndarray | None = None, patch_squares: np.ndarray | None = None,
                      measured: bool = True, array_bytes: np.ndarray | None = None) -> None:
        """The records at these positions of source s are prepared, held by the worker (or by
        each position's worker, an array). measured False: lengths set here, not read from the
        data (records held out or quarantined, 0): they say nothing of the source's mean length."""
        self.prepared_stamp += 1
        before = self.tables[s].set_prepared(positions, lengths, worker_id, patches, patch_squares, array_bytes)
        changed = (before >= 0) & (before != lengths)
        for pos, was, now in zip(positions[changed].tolist(), before[changed].tolist(), lengths[changed].tolist()):
            log.error("source %s position %d: length %d differs from earlier %d (non-deterministic transform?)",
                      self.job.sources[s].name, pos, now, was)
        new = before < 0
        if measured:
            self.len_sum[s] += int(lengths[new].sum())
            self.len_count[s] += int(new.sum())
        policy = self.job.sources[s].long_docs
        if policy != "split":  # records longer than a row, as prepared (the seq_len of the plan's stage)
            long = int((lengths[new] > self.job.seq_len_at(self.planner.state.next_step)).sum())
            if long:
                key = "truncated" if policy == "truncate" else "dropped"
                self.long_docs[s][key] = self.long_docs[s].get(key, 0) + long
        if self.reprepare:
            self.reprepare.difference_update((s, p) for p in positions.tolist())

    # ------------------------------------------------------------------ the plan's side of the planner

    def window(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(records, lengths) of stream positions [start, start+count): what the planner may use
        (plan.Known). Length -1: not prepared yet."""
        return self.tables[source].window(start, count)

    def patches(self, source: int, positions: np.ndarray) -> np.ndarray:
        """Image patches of prepared records (plan.Known)."""
        return self.tables[source].patches(positions)

    def patch_squares(self, source: int, positions: np.ndarray) -> np.ndarray:
        """Per prepared record, its images' patches squared, summed (plan.Known)."""
        return self.tables[source].patch_squares(positions)
