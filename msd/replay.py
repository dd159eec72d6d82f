"""Planning outside a running job: the real Planner over the job's real data, with every record
length found in this process the way a worker finds it (memory-mapped sources from their index,
the others read and tokenized with the worker's own readers), and no workers or sockets.

The plan is a pure function of the job file, the seed, the data and the run-time changes the
state dir journaled (mixture changes, quarantined records), so any journaled step can be planned
again here exactly as the running coordinator planned it. `msd manifest`, `msd where` and
`msd plan` are built on this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from worker.samples import SourceReader, open_source

from msd_common.spec import CostConfig, JobConfig, load_job
from coordinator.journal import JournalFile, read_cost_journal, read_mixture_journal, read_quarantine_journal
from coordinator.plan import OFFSET, LENGTH, POSITION, RECORD, SOURCE, Planner, PlannerState, StepPlan
from coordinator.sources import OpenedSources, mapped_lengths, open_sources
from coordinator.statedir import STATE_FILE, read_state_file

log = logging.getLogger("msd.replay")


class ReplayError(Exception):
    """A step that cannot be planned again from this state dir (the message says why)."""


class LocalLengths:
    """plan.Known with lengths found in this process. A record a worker would skip (unreadable, over a
    limit, quarantined) has length 0, as in the running job."""

    def __init__(self, job: JobConfig, opened: OpenedSources, planner: Planner,
                 quarantined: dict[int, set[int]] | None = None) -> None:
        self.job = job
        self.opened = opened
        self.planner = planner
        self.quarantined = quarantined or {}
        self.specs = job.worker_job().sources
        self._readers: dict[int, SourceReader] = {}
        # (record, epoch) -> (length, patches, patch squares); the epoch matters only to a transform (else 0)
        self._known: list[dict[tuple[int, int], tuple[int, int, int]]] = [{} for _ in job.sources]
        self.skipped: list[dict[int, str]] = [{} for _ in job.sources]  # record -> why (the worker's log line)

    def reader(self, source: int) -> SourceReader:
        """The source's samples as a worker makes them (a memory-mapped source's lengths come from the
        index the coordinator opened; its tokens are read here as a worker reads them)."""
        if source not in self._readers:
            self._readers[source] = open_source(self.specs[source])
        return self._readers[source]

    def window(self, source: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        records = self.planner.streams[source].records_array(start, count)
        return records, self.lengths(source, records, self._epochs(source, np.arange(start, start + len(records))))

    def _epochs(self, source: int, positions: np.ndarray) -> list[int]:
        """Each position's epoch where the source's samples may depend on it (a transform), else 0."""
        if not self.job.sources[source].transform:
            return [0] * len(positions)
        return (np.asarray(positions, dtype=np.int64) // max(1, self.planner.num_records[source])).tolist()

    def patches(self, source: int, positions: np.ndarray) -> np.ndarray:
        return self._field(source, positions, 1)

    def patch_squares(self, source: int, positions: np.ndarray) -> np.ndarray:
        return self._field(source, positions, 2)

    def _field(self, source: int, positions: np.ndarray, k: int) -> np.ndarray:
        stream = self.planner.streams[source]
        epochs = self._epochs(source, positions)
        return np.array([self._read(source, stream.record_at(int(p)), e)[k] for p, e in zip(positions.tolist(),
                                                                                            epochs)],
                        dtype=np.int64)

    def lengths(self, source: int, records: np.ndarray, epochs: list[int] | None = None) -> np.ndarray:
        if source in self.opened.mapped:
            lengths, _ = mapped_lengths(self.opened.mapped[source], self.job.sources[source], records)
        else:
            epochs = epochs if epochs is not None else [0] * len(records)
            lengths = np.array([self._read(source, r, e)[0] for r, e in zip(records.tolist(), epochs)], dtype=np.int64)
        bad = self.quarantined.get(source)
        if bad:
            lengths = np.where(np.isin(records, np.fromiter(bad, dtype=np.int64)), 0, lengths)
        return lengths

    def _read(self, source: int, record: int, epoch: int = 0) -> tuple[int, int, int]:
        """(length, patches, its images' patches squared, summed) of a record, as a worker reports them."""
        known = self._known[source].get((record, epoch))
        if known is None:
            reader = self.reader(source)
            try:
                prepared = reader.read_prepared(record, epoch)
                known = (len(prepared.tokens), prepared.patch_count, prepared.patch_squares)
            except Exception as e:  # noqa: BLE001 - skipped as a worker skips it
                self.skipped[source][record] = f"{reader.where(record)}: {e}"
                known = (0, 0, 0)
            self._known[source][(record, epoch)] = known
        return known


@dataclass
class Replay:
    """A planner set up as a state dir's coordinator would be, and lengths found locally."""

    job: JobConfig
    planner: Planner
    known: LocalLengths
    journaled: dict[int, dict]  # step -> planner state before it, from the step journal

    def plan_from(self, step: int) -> Iterator[StepPlan]:
        """Plan step `step` and the steps after it, one at a time, as the job planned them: from
        the journaled state before `step` (or the latest journaled one before it)."""
        earlier = [s for s in self.journaled if s <= step]
        if not earlier:
            oldest = min(self.journaled) if self.journaled else None
            raise ReplayError(f"step {step} is not in the journal (it holds steps {oldest}..{self.last_step})"
                              if oldest is not None else "the step journal is empty")
        self.planner.state = PlannerState.from_json(self.journaled[max(earlier)])
        while True:
            plan = self.planner.plan_step(self.known)
            if plan.step >= step:
                yield plan
            for event in self.planner.events:
                log.info("%s", event)
            self.planner.events.clear()

    @property
    def last_step(self) -> int:
        """The last step the journal says was planned."""
        return max(self.journaled) - 1 if self.journaled else -1


def job_of_state_dir(state_dir: str, config: str | None = None) -> JobConfig:
    """The job a state dir was written for: `config`, or the job file its coordinator recorded."""
    if config is None:
        try:
            config = read_state_file(state_dir)["job"]
        except (OSError, ValueError, KeyError) as e:
            raise ReplayError(f"{state_dir}: no {STATE_FILE} naming the job file ({e}); pass --config") from None
    return load_job(config)


def open_replay(state_dir: str, job: JobConfig) -> Replay:
    """A Replay of the state dir's run: its journaled planner states, mixture changes and quarantined
    records over the job's sources."""
    opened = open_sources(job)
    planner = Planner(job, opened.num_records)
    for at_step, weights in read_mixture_journal(state_dir):
        planner.set_weights(at_step, weights, replaying=True)
    for at_step, (q, lin, _, pq, pl) in read_cost_journal(state_dir):
        planner.set_cost(at_step, CostConfig(q, lin, pq, pl), replaying=True)
    names = {s.name: s.index for s in job.sources}
    quarantined: dict[int, set[int]] = {}
    for name, record in read_quarantine_journal(state_dir):
        if name in names:
            quarantined.setdefault(names[name], set()).add(record)
    try:
        states = JournalFile(state_dir, job.digest(), (job.digest_before_0_4(),)).load()
    except ValueError as e:
        raise ReplayError(str(e)) from None
    journaled = {int(s["next_step"]): s for s in states}  # a step journaled twice (a rewind): the same state
    return Replay(job, planner, LocalLengths(job, opened, planner, quarantined), journaled)


def fresh_plan(job: JobConfig) -> tuple[Planner, LocalLengths]:
    """A planner at step 0 of the job, for a dry run."""
    opened = open_sources(job)
    planner = Planner(job, opened.num_records)
    return planner, LocalLengths(job, opened, planner)


def manifest_of(plan: StepPlan, job: JobConfig, known: LocalLengths, rank: int | None = None,
                resolve: bool = False) -> dict[str, Any]:
    """What a step held, per rank, micro-batch and sequence (row), piece by piece in delivery order."""
    from msd_common.doc_keys import doc_key

    names = [s.name for s in job.sources]
    ranks: dict[int, list] = {}
    for i in range(len(plan.pieces)):
        r = int(plan.rank[i])
        if rank is not None and r != rank:
            continue
        p = plan.pieces[i]
        s, record = int(p[SOURCE]), int(p[RECORD])
        piece = {"micro_batch": int(plan.micro_batch[i]), "sequence": int(plan.row[i]) % job.batch.micro_batch_size,
                 "source": names[s], "doc_key": int(doc_key(s, record)), "record": record,
                 "position": int(p[POSITION]), "offset": int(p[OFFSET]), "length": int(p[LENGTH])}
        if resolve:
            piece["where"] = known.reader(s).where(record)
        ranks.setdefault(r, []).append(piece)
    return {"step": plan.step, "dp": job.dp, "rank_costs": list(plan.rank_costs),
            "source_tokens": {names[s]: int(t) for s, t in enumerate(plan.source_tokens)},
            "ranks": {str(r): pieces for r, pieces in sorted(ranks.items())}}
