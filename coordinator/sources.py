"""Opening the job's sources at coordinator start-up: record counts per source, and a clear
refusal (naming the file) of missing, truncated or foreign shards. Payloads are not read here."""

from __future__ import annotations

from worker.readers import SourceFormatError, open_source

from .config import ConfigError, JobConfig


def count_records(job: JobConfig) -> list[int]:
    """Records per source, in source_index order. Builds JSONL offset indexes on first use."""
    counts: list[int] = []
    problems: list[str] = []
    for spec in job.worker_job()["sources"]:
        try:
            counts.append(open_source(spec).num_records)
        except SourceFormatError as e:
            problems.append(f"sources.{spec['name']}: {e}")
            counts.append(0)
    for s, n in zip(job.sources, counts):
        if n == 0 and job.weights.get(s.name, 0) > 0 and not any(p.startswith(f"sources.{s.name}:") for p in problems):
            problems.append(f"sources.{s.name}: no records in {len(s.files)} file(s), but its weight is > 0")
    if problems:
        raise ConfigError(job.path, problems)
    return counts
