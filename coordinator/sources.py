"""Opening the job's sources at coordinator start-up: record counts per source, and a clear
refusal (naming the file) of missing, truncated or foreign shards. Payloads are not read here."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from msd_common.formats.errors import SourceFormatError
from msd_common.formats.records import SourceRecords
from msd_common.formats import indexing
from msd_common.formats.storage import is_url, store_for

from msd_common.spec import ConfigError, JobConfig


@dataclass
class OpenedSources:
    num_records: list[int]  # per source, in source_index order
    # memory-mapped (Megatron) sources by index, kept open: the coordinator reads their lengths
    # from the index itself instead of asking a worker
    mapped: dict[int, SourceRecords] = field(default_factory=dict)
    # sources with shards this host has no index of, left to the workers to index and count
    # (runtime.index_on: workers): their num_records are 0 until counted (with_counts)
    pending: dict[int, list[str]] = field(default_factory=dict)

    def with_counts(self, job: JobConfig, counts: dict[int, int]) -> "OpenedSources":
        """The pending sources' records, as the workers counted them; raises ConfigError for a
        source with no records but a weight."""
        num_records = [counts.get(s, n) for s, n in enumerate(self.num_records)]
        _check_not_empty(job, num_records, [])
        return OpenedSources(num_records, self.mapped)


def open_sources(job: JobConfig, index_here: bool = True, meanwhile: Callable[[],
                                                                              object] | None = None) -> OpenedSources:
    """Open every source once (building missing shard indexes first, in parallel); raises ConfigError
    naming each source that cannot be opened, or that has no records but a weight. With
    index_here False, a JSONL or WebDataset source with a shard this host has no index of is
    not opened but left pending, for the workers to index and count (coordinator/counting.py).
    meanwhile: the caller's own work, done while the indexing pool runs (indexing.build_indexes)."""
    counts: list[int] = []
    mapped: dict[int, SourceRecords] = {}
    problems: list[str] = []
    specs = job.worker_job().sources
    pending = {} if index_here else indexing.unindexed_shards(specs)
    # Shards without an index yet are indexed by all cores at once; a shard that fails here fails
    # again below, where its source's error is reported.
    if index_here:
        indexing.build_indexes(specs, meanwhile=meanwhile)
    for i, spec in enumerate(specs):
        if i in pending:
            counts.append(0)
            continue
        try:
            reader = SourceRecords.of(spec)
        except SourceFormatError as e:
            problems.append(f"sources.{spec.name}: {e}")
            counts.append(0)
            continue
        counts.append(reader.num_records)
        if reader.memory_mapped:  # (a Megatron source in object storage is prepared by workers)
            mapped[spec.index] = reader
    _check_not_empty(job, counts, problems, skip=set(pending))
    return OpenedSources(counts, mapped, pending)


def open_as_coordinator(job: JobConfig, meanwhile: Callable[[], object] | None = None) -> OpenedSources:
    """The sources as `msd coordinator` opens them: indexed here, or, with runtime.index_on:
    workers, those this host has no index of left pending for the workers."""
    return open_sources(job, index_here=job.runtime.index_on == "coordinator", meanwhile=meanwhile)


def _check_not_empty(job: JobConfig, counts: list[int], problems: list[str], skip: set[int] = frozenset()) -> None:
    for i, (s, n) in enumerate(zip(job.sources, counts)):
        if (i not in skip and n == 0 and job.weights.get(s.name, 0) > 0
                and not any(p.startswith(f"sources.{s.name}:") for p in problems)):
            problems.append(f"sources.{s.name}: no records in {len(s.files)} file(s), but its weight is > 0")
    if problems:
        raise ConfigError(job.path, problems)


def mapped_lengths(reader: SourceRecords, source: Any, records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of memory-mapped records from their index, and which are over the source's
    max_record_bytes (length 0: skipped, as a worker would skip them)."""
    lengths = reader.lengths(records)
    over = lengths * reader.dtype.itemsize > source.max_record_bytes
    return np.where(over, 0, lengths), over


def check_readable(job: JobConfig) -> None:
    """Read the first byte of every remote object of the job (Megatron: the .idx and the .bin),
    many at once; raises ConfigError naming each URL that is missing or cannot be read (a
    listing may show objects that the job's credentials cannot read)."""
    objects = [(s, url) for s in job.sources for f in s.files if is_url(f)
               for url in ((f + ".idx", f + ".bin") if s.format == "megatron" else (f,))]
    if not objects:
        return

    def problem(item: tuple[Any, str]) -> str | None:
        source, url = item
        store = store_for(url, source.storage)
        try:
            size = store.stamp(url)[0]
            store.read(url, 0, min(1, size))
        except Exception as e:  # noqa: BLE001 - reported, naming the URL
            return f"sources.{source.name}: {url}: cannot be read ({e})"
        return None

    with ThreadPoolExecutor(max_workers=16) as pool:
        problems = [p for p in pool.map(problem, objects) if p]
    if problems:
        raise ConfigError(job.path, problems)
