"""Skipped records and quarantine: what the coordinator counts and decides about records that make
no sample. It returns what to write (instructions); the state carries them out with the rest.

- a record a worker skipped (corrupt, too large, a transform's error) is counted by kind;
- a transform failing on max_transform_errors records in a row is broken, not the data: the
  job stops, naming it;
- a record that killed ALLOWED_DEATHS worker processes (each try on another worker), or whose
  sample ran past max_sample_s, is quarantined: journaled, and skipped wherever it is drawn.
"""

from __future__ import annotations

import logging

from msd_common.spec import JobConfig

from .instructions import AppendQuarantine, Instruction
from .tasks import PrepareTask

log = logging.getLogger("msd.coordinator")

# A record is quarantined when this many worker processes died working on it (the first try and
# two retries, each on another worker): it kills whatever reads it, so it is skipped from then on.
ALLOWED_DEATHS = 3


class SkipBook:
    def __init__(self, job: JobConfig, durable: bool) -> None:
        self.job = job
        self.durable = durable  # quarantined records are journaled
        n = len(job.sources)
        self.by_kind: list[dict[str, int]] = [{} for _ in range(n)]  # per source: kind -> count
        self.transform_errors: dict[int, int] = {}  # per source: consecutive transform errors so far
        self.quarantined: dict[int, set[int]] = {}  # source -> records never handed to a worker again

    def count(self, s: int, kind: str, n: int = 1) -> None:
        self.by_kind[s][kind] = self.by_kind[s].get(kind, 0) + n

    def skipped(self, s: int) -> int:
        return sum(self.by_kind[s].values())

    def transform_failure(self, s: int, skipped: list, n_records: int) -> str | None:
        """Count a source's consecutive transform errors (in task order); at max_transform_errors
        the transform is broken, not the data: the reason to stop the job (naming the source, the
        record and the last traceback), else None."""
        errors = {i: reason for i, reason, kind in skipped if kind == "transform_error"}
        src = self.job.sources[s]
        run = self.transform_errors.get(s, 0)
        for i in range(n_records):
            run = run + 1 if i in errors else 0
            if run >= src.max_transform_errors:
                return (f"source {src.name!r}: {run} consecutive records failed in transform {src.transform} "
                        f"(max_transform_errors: {src.max_transform_errors}); the last: {errors[i]}")
        self.transform_errors[s] = run
        return None

    def quarantine(self, s: int, record: int, reason: str) -> list[Instruction]:
        """A poison record: skipped from now on (settled as length 0 wherever it is drawn), and
        journaled before any step planned without it."""
        if record in self.quarantined.get(s, ()):
            return []
        name = self.job.sources[s].name
        log.error("source %s: record %d quarantined: %s; it is skipped from now on", name, record, reason,
                  extra={"source": name, "record": record})
        self.quarantined.setdefault(s, set()).add(record)
        return [AppendQuarantine(name, record, reason)] if self.durable else []

    def replay(self, name: str, record: int) -> bool:
        """A record quarantined earlier in the run; False if this job has no such source."""
        source = next((src.index for src in self.job.sources if src.name == name), None)
        if source is None:
            return False
        self.quarantined.setdefault(source, set()).add(record)
        return True

    def death(self, task: PrepareTask, worker_id: int, record_of_single: int | None) -> tuple[str, list[Instruction]]:
        """A worker died working on this task: what to do with it ("split" it record by record,
        "retry" it elsewhere, "wait" for the worker it went to since, or "quarantined"), and what
        to write. record_of_single: the task's one record, for a task of one."""
        task.deaths += 1
        name = self.job.sources[task.source].name
        if task.worker_id is not None:  # handed to another worker already: judged when that one is done
            return "wait", []
        if len(task.positions) > 1:
            log.warning("worker %d died working on %d records of source %s; trying them one by one", worker_id,
                        len(task.positions), name, extra={"worker_id": worker_id})
            return "split", []
        if task.deaths < ALLOWED_DEATHS:
            log.warning("worker %d died working on record %d of source %s (%d of %d allowed deaths); trying another "
                        "worker", worker_id, record_of_single, name, task.deaths, ALLOWED_DEATHS,
                        extra={"worker_id": worker_id})
            return "retry", []
        return "quarantined", self.quarantine(task.source, record_of_single,
                                              f"{task.deaths} worker processes died reading it")
