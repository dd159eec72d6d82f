"""Opening the job's sources at coordinator start-up: record counts per source, and a clear
refusal (naming the file) of missing, truncated or foreign shards. Payloads are not read here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from worker.readers import SourceFormatError, SourceReader, open_source
from worker.readers.indexing import build_indexes

from .config import ConfigError, JobConfig


@dataclass
class OpenedSources:
    num_records: list[int]  # per source, in source_index order
    # memory-mapped (Megatron) sources by index, kept open: the coordinator reads their lengths
    # from the index itself instead of asking a worker
    mapped: dict[int, SourceReader] = field(default_factory=dict)


def open_sources(job: JobConfig) -> OpenedSources:
    """Open every source once (building missing shard indexes first, in parallel); raises ConfigError
    naming each source that cannot be opened, or that has no records but a weight."""
    counts: list[int] = []
    mapped: dict[int, SourceReader] = {}
    problems: list[str] = []
    specs = job.worker_job()["sources"]
    # Shards without an index yet are indexed by all cores at once; a shard that fails here fails
    # again below, where its source's error is reported.
    build_indexes(specs)
    for spec in specs:
        try:
            reader = open_source(spec)
        except SourceFormatError as e:
            problems.append(f"sources.{spec['name']}: {e}")
            counts.append(0)
            continue
        counts.append(reader.num_records)
        if spec["format"] == "megatron":
            mapped[spec["index"]] = reader
    for s, n in zip(job.sources, counts):
        if n == 0 and job.weights.get(s.name, 0) > 0 and not any(p.startswith(f"sources.{s.name}:") for p in problems):
            problems.append(f"sources.{s.name}: no records in {len(s.files)} file(s), but its weight is > 0")
    if problems:
        raise ConfigError(job.path, problems)
    return OpenedSources(counts, mapped)


def mapped_lengths(reader: SourceReader, source: Any, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of memory-mapped records from their index, and which are over the source's
    max_record_bytes (length 0: skipped, as a worker would skip them)."""
    lengths = reader.lengths(records)
    over = lengths * reader.dtype.itemsize > source.max_record_bytes
    return np.where(over, 0, lengths), over
