"""What one worker process does with the coordinator's messages, without sockets: `WorkerCore.handle`
turns a decoded message into actions (messages to send, and what happened to the registration),
which the loop (`worker/loop.py`) carries out.

Two kinds of work: PREPARE (read and transform records, keep the result in a cache, answer
with lengths only) and DELIVER (send token ranges of cached or memory-mapped records straight to
trainer ranks, one message per rank, then acknowledge). Everything here is a cache the
coordinator can rebuild elsewhere.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from msd_common import protocol as P
from msd_common.doc_keys import doc_key, split_doc_key
from msd_common.errors import ProtocolError
from msd_common.formats import indexing
from msd_common.formats.errors import RecordError
from msd_common.protocol import DELIVER_ITEM
from msd_common.session import LOST_MESSAGES, Forgotten
from msd_common.usercode import TransformImportError, code_hash
from msd_common.worker_job import SourceSpec, WorkerJob

from .processor import ProcessedSample
from .samples import SourceReader, open_source

log = logging.getLogger("msd.worker")


# A pieces message carries at most this many bytes of a processor's arrays: a rank's step of
# images is split over several (each one frame of a few MB a sample: the frame limit stays far off,
# and neither side holds one huge message)
MESSAGE_EXTRA_BYTES = 256 << 20


@dataclass(slots=True)
class CacheEntry:
    """A prepared record: its tokens (and image patches), and how many prepared copies of it the
    coordinator counts on (one per stream position; each delivery that uses one up releases it)."""

    tokens: np.ndarray
    copies: int
    images: np.ndarray | None = None  # patches of its image placeholders (its first tokens)
    loss_mask: np.ndarray | None = None  # uint8 per token, from a transform or chat rendering
    processed: ProcessedSample | None = None  # a processor's arrays (sources with `processor`)
    patch_count: int = 0  # its image patches (PREPARED's patches; Prepared.patch_count)
    patch_squares: int = 0  # its images' patches squared, summed (PREPARED's patch_squares)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def array_bytes(self) -> int:
        """What it sends beside its tokens: its image patches, or a processor's arrays (planned
        frames included)."""
        if self.processed is not None:
            return sum(self.processed.array_bytes.values())
        return self.images.nbytes if self.images is not None else 0


# Actions: what the loop is asked to do.
@dataclass(frozen=True, slots=True)
class ToCoordinator:
    message: P.Message


@dataclass(frozen=True, slots=True)
class ToRank:
    address: str  # the rank's data socket
    message: P.Pieces  # its `tail`: a processor's arrays, a frame each, never copied into one


@dataclass(frozen=True, slots=True)
class ReleaseRank:
    """The rank at this data address is gone: drop what waits for it."""

    address: str


@dataclass(frozen=True, slots=True)
class Registered:
    worker_id: int
    heartbeat_s: float


@dataclass(frozen=True, slots=True)
class Quit:
    reason: str


@dataclass(frozen=True, slots=True)
class CoordinatorStopping:
    """The coordinator stops (or its job failed): hello to the next address, or again, until one serves."""

    reason: str


Action = ToCoordinator | ToRank | ReleaseRank | Registered | Forgotten | Quit | CoordinatorStopping


# Fault injection for tests and drills: `MSD_KILL_RECORDS=source:record,...` makes a worker process
# kill itself with SIGKILL when it is about to read one of these records, as a crash in a native
# decoder or the OOM killer would. Nothing else can make a process die on one given record.
KILL_RECORDS_ENV = "MSD_KILL_RECORDS"
# fault injection for tests: "source:record=seconds,..." makes reading those records that slow
SLOW_RECORDS_ENV = "MSD_TEST_SLOW_RECORDS"


def _slow_records(specs: Sequence[SourceSpec]) -> dict[tuple[int, int], float]:
    index = {spec.name: s for s, spec in enumerate(specs)}
    out: dict[tuple[int, int], float] = {}
    for item in filter(None, (x.strip() for x in os.environ.get(SLOW_RECORDS_ENV, "").split(","))):
        where, _, seconds = item.partition("=")
        name, _, record = where.rpartition(":")
        try:
            out[(index[name], int(record))] = float(seconds)
        except (KeyError, ValueError):
            log.warning("%s: %r is not source:record=seconds of this job; ignored", SLOW_RECORDS_ENV, item)
    return out


def _kill_records(specs: Sequence[SourceSpec]) -> dict[int, set[int]]:
    raw = os.environ.get(KILL_RECORDS_ENV, "")
    index = {spec.name: s for s, spec in enumerate(specs)}
    out: dict[int, set[int]] = {}
    for item in filter(None, (x.strip() for x in raw.split(","))):
        name, _, record = item.rpartition(":")
        if name in index and record.isdigit():
            out.setdefault(index[name], set()).add(int(record))
        else:
            log.warning("%s: %r is not source:record of this job; ignored", KILL_RECORDS_ENV, item)
    return out


def _cache_key(key: int, epoch: int) -> int:
    """A prepared copy's key in the cache: the record's doc key and its epoch (a transform's
    sample may differ between epochs, and two epochs of a small source can be prepared at once)."""
    return int(key) | (int(epoch) << 64)


def _epochs(epochs: np.ndarray | None, n: int) -> np.ndarray:
    """The epochs of a message's records (none given: every one 0)."""
    return np.zeros(n, np.int64) if epochs is None or not len(epochs) else np.asarray(epochs, dtype=np.int64)


def _processor_problem(spec: SourceSpec) -> str:
    """Why this host cannot make a processor source's samples ("" when it can)."""
    from msd_common.processor_dir import ProcessorDirError, processor_digest, read_processor_dir

    try:
        read_processor_dir(spec.processor)
    except ProcessorDirError as e:
        return str(e)
    if spec.processor_hash and processor_digest(spec.processor) != spec.processor_hash:
        return f"processor directory {spec.processor} differs from the coordinator's (files hash differently)"
    try:
        from .processor import load_processor

        load_processor(spec.processor, spec.image_backend)
    except ImportError as e:
        return f"cannot load the processor ({e}); install msd[vision] on worker hosts"
    except Exception as e:  # noqa: BLE001 - transformers' own errors for a directory it cannot load
        return f"cannot load the processor of {spec.processor}: {type(e).__name__}: {e}"
    return ""


def _die_as_a_native_crash_would(where: str) -> None:
    log.error("%s: %s names this record; the process kills itself", where, KILL_RECORDS_ENV)
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL)


class DeliveryPieces:
    """The pieces of one delivery, row by row (DELIVER_ITEM rows), joined into a message per rank."""

    def __init__(self, items: np.ndarray, sources: np.ndarray) -> None:
        n = len(items)
        self.items, self.sources = items, sources
        self.servable = np.zeros(n, dtype=bool)
        self.tokens: list[Any] = [None] * n
        self.masks: list[Any] = [0] * n  # a piece's loss mask, or its length where it has none (all 1)
        self.images: list[Any] = [None] * n
        self.patch_counts = np.zeros(n, dtype=np.uint32)
        # a processor's arrays of each piece: {name: array}, per-token ones sliced to the piece;
        # the image ones go with the piece that starts the sample
        self.extras: list[dict[str, np.ndarray] | None] = [None] * n
        self.extra_specs: dict[str, tuple[str, int]] = {}  # name -> (dtype, per_token)

    def add_extras(self, i: int, processed: ProcessedSample, offset: int, n: int) -> None:
        extras = {}
        for name, a in processed.token_arrays.items():
            extras[name] = a[offset: offset + n]
            self._declare(name, a, True)
        if offset == 0:
            for name, a in processed.image_arrays.items():
                extras[name] = a
                self._declare(name, a, False)
        self.extras[i] = extras

    def message_rows(self, mine: np.ndarray) -> list[np.ndarray]:
        """The rows `mine` selects, as one message's or, where a processor's arrays would make it
        more frames than a message may carry or more than MESSAGE_EXTRA_BYTES, or hold an array in
        two row shapes (a message declares one: a processor's batch of one, or its patches padded
        per sample), several messages' (a rank takes a step's pieces from any number of messages)."""
        rows = np.flatnonzero(mine)
        if not self.extra_specs or not len(rows):
            return [mine]
        out, start, count, size, shapes = [], 0, 0, 0, {}
        for k, i in enumerate(rows.tolist()):
            extras = self.extras[i] or {}
            frames, nbytes = len(extras), sum(a.nbytes for a in extras.values())
            reshaped = any(shapes.get(name, a.shape[1:]) != a.shape[1:] for name, a in extras.items())
            if k > start and (count + frames > P.MAX_EXTRA_FRAMES or size + nbytes > MESSAGE_EXTRA_BYTES or reshaped):
                out.append(rows[start:k])
                start, count, size, shapes = k, 0, 0, {}
            count += frames
            size += nbytes
            for name, a in extras.items():
                shapes.setdefault(name, a.shape[1:])
        out.append(rows[start:])
        if len(out) == 1:
            return [mine]
        masks = []
        for chunk in out:
            m = np.zeros(len(mine), dtype=bool)
            m[chunk] = True
            masks.append(m)
        return masks

    def _declare(self, name: str, a: np.ndarray, per_token: bool) -> None:
        if name not in self.extra_specs:
            self.extra_specs[name] = (a.dtype.newbyteorder("<").str if a.dtype.itemsize > 1 else a.dtype.str,
                                      int(per_token))

    def join_extras(self, order: list[int]) -> tuple[list, np.ndarray, list[np.ndarray]]:
        """The extras of these pieces (in order): their declarations, rows [items x extras], and
        the arrays that have rows, item by item in declaration order (each its own frame: the
        pixel values, megabytes a sample, go to zmq as they are, never concatenated)."""
        names = sorted({name for i in order if self.extras[i] for name in self.extras[i]})
        if not names:
            return [], np.zeros(0, np.uint32), []
        specs = []  # [name, dtype, row shape, per_token]: the row shape of this message's (one: message_rows)
        for name in names:
            first = next(self.extras[i][name] for i in order if self.extras[i] and name in self.extras[i])
            dtype, per_token = self.extra_specs[name]
            specs.append([name, dtype, list(first.shape[1:]), per_token])
        rows = np.zeros((len(order), len(names)), np.uint32)
        frames = []
        for k, i in enumerate(order):
            for j, name in enumerate(names):
                a = (self.extras[i] or {}).get(name)
                if a is not None and len(a):
                    rows[k, j] = len(a)
                    frames.append(np.ascontiguousarray(a, dtype=specs[j][1]).reshape(-1).view(np.uint8))
        return specs, rows.reshape(-1), frames

    def join(self, mine: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
        """One rank's message from the rows `mine` selects: its servable rows grouped by source
        (in row order within a source), their tokens concatenated, for image-text records the
        patches of the image placeholders each piece holds (placeholders are a record's first
        tokens, one per patch), and the loss mask of every token where any piece has one (else
        empty: text costs nothing more): (rows, tokens, patches per row, patches, loss mask).
        None where none of its rows can be served."""
        at = np.flatnonzero(mine & self.servable)
        if not len(at):
            return None
        at = at[np.argsort(self.sources[at], kind="stable")]
        order = at.tolist()
        tokens = np.concatenate([self.tokens[i] for i in order])
        images = [self.images[i] for i in order if self.images[i] is not None]
        patches = np.concatenate(images) if images else np.zeros((0, 0), np.uint8)
        patch_counts = self.patch_counts[at] if patches.size else self.patch_counts[:0]
        masks = [self.masks[i] for i in order]
        mask = np.concatenate([m if isinstance(m, np.ndarray) else np.ones(m, np.uint8) for m in masks]) \
            if any(isinstance(m, np.ndarray) for m in masks) else np.zeros(0, np.uint8)
        return self.items[at], tokens, patch_counts, patches, mask, *self.join_extras(order)


class WorkerCore:
    def __init__(self) -> None:
        self.worker_id: int | None = None
        self.specs: Sequence[SourceSpec] = ()
        self.readers: dict[int, SourceReader] = {}
        self.cache: dict[int, CacheEntry] = {}  # doc key -> entry (memory-mapped records are never cached)
        self.kill_records: dict[int, set[int]] = {}  # fault injection (KILL_RECORDS_ENV), by source index
        self.slow_records: dict[tuple[int, int], float] = {}  # fault injection (SLOW_RECORDS_ENV)
        # [source, record, reason, kind] of planned samples whose image pass failed at delivery
        self.delivery_failures: list[list] = []
        self.job_failed: str | None = None  # the reason a failed job's coordinator gave, once logged
        # Called between the parts of long work (each source opened, each record read, each
        # source gathered): the loop cannot heartbeat while the core works, and a worker busy
        # for three heartbeats (opening hundreds of sources with a cold page cache) was taken
        # for dead. The worker loop sets it to send a heartbeat when one is due.
        self.keep_alive: Callable[[], None] = lambda: None
        # (source, record, max_sample_s) when a bounded piece of work starts (a sample; loading a
        # processor at welcome: source and record -1), (.., .., 0) when it is done: the host
        # agent's clock of it (worker/loop.py). The agent vouches for the worker meanwhile (its
        # heartbeats wait on the work) and stops it past the limit
        self.on_sample: Callable[[int, int, float], None] = lambda s, r, limit: None

    def handle(self, msg: P.Message) -> list[Action]:
        if isinstance(msg, P.Welcome):
            return self._on_welcome(msg)
        if isinstance(msg, P.UnknownPeer):
            # The coordinator forgot us (restart, or we were silent too long): everything we hold
            # may have been re-prepared elsewhere, so start clean and register again.
            log.warning("coordinator does not know this worker (%s); registering again", msg.reason)
            self.worker_id = None
            self.cache.clear()
            return [Forgotten()]
        if isinstance(msg, P.Reject):
            log.error("coordinator rejected this worker: %s", msg.reason)
            return [Quit(msg.reason)]
        if isinstance(msg, (P.Shutdown, P.JobFailed)):
            # The coordinator stops (a standby may take over) or its job failed (it lingers, naming
            # why): what we hold is the old registration's; wait for a coordinator that serves.
            if isinstance(msg, P.Shutdown):
                log.info("coordinator stopping: %s; waiting for a coordinator to serve", msg.reason)
            elif msg.reason != self.job_failed:  # said once: every hello is answered so
                self.job_failed = msg.reason
                log.error("the job failed: %s; waiting for a coordinator to serve", msg.reason)
            self.worker_id = None
            self.cache.clear()
            return [CoordinatorStopping(msg.reason)]
        if self.worker_id is None:  # work for a registration we no longer have
            return []
        if isinstance(msg, (P.Prepare, P.Deliver)) and msg.worker_id != self.worker_id:
            # sent to an earlier registration of ours (the coordinator forgot it, and what it held
            # is prepared again elsewhere): done now, it would spend copies the books no longer count
            log.info("%s for worker %d dropped: this process is worker %d now", msg.TYPE, msg.worker_id,
                     self.worker_id)
            return []
        if isinstance(msg, P.Prepare):
            return self._on_prepare(msg)
        if isinstance(msg, P.Deliver):
            return self._on_deliver(msg)
        if isinstance(msg, P.ReleaseRank):
            return [ReleaseRank(msg.address)]
        return []

    def _on_welcome(self, msg: P.Welcome) -> list[Action]:
        try:
            job = WorkerJob.from_wire(msg.job)
        except ProtocolError as e:
            log.error("welcome without a usable job description (%s); ignored", e)
            return []
        self.worker_id = msg.worker_id
        self.specs = job.sources
        self.readers.clear()
        self.cache.clear()
        self.kill_records = _kill_records(self.specs)
        self.slow_records = _slow_records(self.specs)
        # Shards this host has no index (or decompressed copy) for yet are built now, shared with
        # this host's other worker processes (a lock per shard), rather than by the first task of
        # each process that opens them, one shard after another, on every host.
        _, problems = indexing.build_indexes_shared(self.specs, self.keep_alive, first=self.worker_id)
        for shard, problem in problems.items():
            log.warning("%s: cannot index it on this host (%s); tasks reading it fail", shard, problem)
        # A transform is part of the job's identity: a host whose copy of its code differs from the
        # coordinator's would make another stream, so it does not serve.
        for spec in self.specs:
            if spec.transform:
                try:
                    mine = code_hash(spec.transform)
                except TransformImportError as e:
                    log.error("source %s: %s; this worker cannot serve the job, stopping", spec.name, e)
                    return [Quit(f"cannot import transform {spec.transform}")]
                if spec.transform_hash and mine != spec.transform_hash:
                    log.error("source %s: transform %s on this host (code %s) differs from the coordinator's (code "
                              "%s); "
                              "this worker cannot serve the job, stopping", spec.name, spec.transform, mine,
                              spec.transform_hash)
                    return [Quit(f"transform {spec.transform} differs from the coordinator's")]
        # A processor directory decides samples as a transform does, and a host without transformers
        # (msd[vision]) or with another copy of it would skip or change every record: it does not serve.
        for s, spec in enumerate(self.specs):
            if spec.processor:
                self.keep_alive()
                self.on_sample(-1, -1, spec.max_sample_s)  # loading it takes seconds: vouched for meanwhile
                try:
                    problem = _processor_problem(spec)
                finally:
                    self.on_sample(-1, -1, 0.0)
                if problem:
                    log.error("source %s: %s; this worker cannot serve the job, stopping", spec.name, problem)
                    return [Quit(f"source {spec.name}: {problem}")]
        # The coordinator hands out records of memory-mapped sources without asking first, so a
        # worker that cannot open one must not serve: it stops, and its deliveries go elsewhere.
        for s, spec in enumerate(self.specs):
            if spec.memory_mapped:
                self.keep_alive()
                try:
                    self._reader(s)
                except Exception as e:
                    log.error("cannot open source %s on this host (%s); this worker cannot serve the job, stopping",
                              spec.name, e)
                    return [Quit(f"cannot open source {spec.name}")]
        log.info("registered as worker %d with %d sources", self.worker_id, len(self.specs))
        out: list[Action] = [Registered(self.worker_id, float(msg.heartbeat_s))]
        if msg.count:  # the coordinator waits for these sources' record counts before it plans
            out.append(ToCoordinator(self._source_counts(msg.count)))
        return out

    def _source_counts(self, sources: list[int]) -> P.SourceCounts:
        """The records of each of these sources as this host's indexes count them (built just
        above), or why a source cannot be opened here."""
        records, problems = [], []
        for s in sources:
            self.keep_alive()
            try:
                if not 0 <= s < len(self.specs):
                    raise ValueError(f"the job has no source {s}")
                records.append(int(self._reader(s).num_records))
                problems.append("")
            except Exception as e:  # noqa: BLE001 - named to the coordinator, which refuses the job
                records.append(0)
                problems.append(str(e) or type(e).__name__)
        log.info("counted the records of %d sources for the coordinator", len(sources))
        return P.SourceCounts(worker_id=self.worker_id, sources=list(sources), records=records, problems=problems)

    def _reader(self, source: int) -> SourceReader:
        reader = self.readers.get(source)
        if reader is None:
            reader = self.readers[source] = open_source(self.specs[source])
        return reader

    # ------------------------------------------------------------------ prepare

    def _on_prepare(self, msg: P.Prepare) -> list[Action]:
        s, records, epochs = msg.source, msg.records, msg.epochs
        try:
            reader = self._reader(s)
        except Exception as e:  # a source this host cannot open: tell the coordinator, keep serving
            return [ToCoordinator(P.TaskFailed(worker_id=self.worker_id, task_id=msg.task_id,
                                               reason=f"cannot prepare records of source {s}: {e}"))]
        # (The coordinator prepares memory-mapped sources itself, from their index; their tokens
        # are read straight from the map at delivery.)
        skipped: list[list] = []
        patches = np.zeros(len(records) if reader.has_encoder_cost else 0, dtype=np.int64)
        squares = np.zeros(len(patches), dtype=np.int64)  # per record: its images' patches squared, summed
        lengths = np.zeros(len(records), dtype=np.int64)
        nbytes = np.zeros(len(records), dtype=np.int64)  # per record: its arrays beside its tokens
        try:  # remote shards: the task's bytes in a few concurrent requests, not one per record
            reader.prefetch(np.array([r for r, e in zip(records.tolist(), _epochs(epochs, len(records)).tolist())
                                      if _cache_key(doc_key(s, r), e) not in self.cache], np.int64))
        except Exception as e:  # noqa: BLE001 - each record is read (and, if need be, skipped) below
            log.warning("source %s: prefetch failed (%s); reading records one by one", reader.name, e)
        epochs = _epochs(epochs, len(records))
        for i in np.argsort(records, kind="stable").tolist():  # record order: Parquet row groups decode once
            record = int(records[i])
            key = _cache_key(doc_key(s, record), epochs[i])
            entry = self.cache.get(key)
            if entry is None:
                self.keep_alive()
                self.on_sample(s, record, self.specs[s].max_sample_s)
                if record in self.kill_records.get(s, ()):
                    _die_as_a_native_crash_would(reader.where(record))
                try:
                    if (s, record) in self.slow_records:  # (fault injection: a sample this slow)
                        time.sleep(self.slow_records[(s, record)])
                    # an eval copy (EVAL_EPOCH) is the record as in epoch 0, cached apart
                    epoch = 0 if epochs[i] == P.EVAL_EPOCH else int(epochs[i])
                    prepared = reader.read_prepared(record, epoch)
                except RecordError as e:
                    log.warning("source %s: skipped record: %s", reader.name, e,
                                extra={"source": reader.name, "record": record})
                    reason = str(e)
                    if getattr(e, "traceback", None):  # the coordinator names the last one if it stops the job
                        reason = f"{reason}\n{e.traceback}"[:P.MAX_STR_LEN]
                    skipped.append([i, reason, e.kind])
                    continue
                except Exception as e:  # noqa: BLE001 - one bad record among billions must never stop a job
                    reason = f"{reader.where(record)}: {type(e).__name__}: {e}"
                    log.warning("source %s: skipped record: %s", reader.name, reason,
                                extra={"source": reader.name, "record": record})
                    skipped.append([i, reason, "error"])
                    continue
                finally:
                    self.on_sample(s, record, 0.0)
                entry = self.cache[key] = CacheEntry(prepared.tokens, 0, prepared.patches, prepared.loss_mask,
                                                     prepared.processed, prepared.patch_count,
                                                     prepared.patch_squares)
            entry.copies += 1
            lengths[i] = entry.length
            nbytes[i] = entry.array_bytes
            if len(patches):
                patches[i] = entry.patch_count
                squares[i] = entry.patch_squares
        skipped.sort()
        return [ToCoordinator(P.Prepared(worker_id=self.worker_id, task_id=msg.task_id, skipped=skipped, busy_s=0.0,
                                         lengths=lengths, patches=patches, patch_squares=squares,
                                         array_bytes=nbytes if nbytes.any() else np.zeros(0, np.int64)))]

    # ------------------------------------------------------------------ deliver

    def _on_deliver(self, msg: P.Deliver) -> list[Action]:
        items, release, epochs, release_epochs = msg.items, msg.release, msg.epochs, msg.release_epochs
        names = msg.addresses
        addresses = {r: names[i] for r, i in msg.targets.tolist()}
        step = msg.step
        out: list[Action] = []
        # Every piece of the delivery is checked and located once, source by source, then each
        # rank's message is joined from them: per rank, the same numpy calls on a handful of rows
        # cost more than the copy (tools/bench_wait.py at no compute: the workers' CPU per step 2.6-4.1 ms
        # against 1.0-1.5 ms, docs/BENCHMARKS.md).
        pieces = self._read_pieces(step, items, _epochs(epochs, len(items)))
        ranks = items[:, DELIVER_ITEM.rank]
        for rank in np.unique(ranks).tolist():
            address = addresses.get(rank)
            if address is None:
                log.warning("step %d: no address for rank %d; its pieces were not sent", step, rank)
                continue
            for selected in pieces.message_rows(ranks == rank):
                message = pieces.join(selected)
                if message is None:
                    continue
                rows, tokens, patch_counts, patches, mask, extras, extra_rows, frames = message
                out.append(ToRank(address, P.Pieces(
                    step=step, rank=rank, dtype=tokens.dtype.newbyteorder("<").str,
                    patch_bytes=patches.shape[1] if patches.size else 0, extras=extras,
                    items=rows[:, DELIVER_ITEM.piece:], tokens=tokens, patch_counts=patch_counts,
                    patches=patches.reshape(-1), loss_mask=mask, extra_rows=extra_rows, tail=tuple(frames))))
        if self.cache:  # only records that are not memory-mapped are cached
            for key, epoch in zip(release.tolist(), _epochs(release_epochs, len(release)).tolist()):
                key = _cache_key(key, epoch)
                entry = self.cache.get(key)
                if entry is not None:
                    entry.copies -= 1
                    if entry.copies <= 0:
                        del self.cache[key]
        failed, self.delivery_failures = self.delivery_failures, []
        out.append(ToCoordinator(P.Delivered(worker_id=self.worker_id, delivery_id=msg.delivery_id, failed=failed,
                                             unserved=int(len(items) - pieces.servable.sum()))))
        return out

    def _servable(self, step: int, reader: SourceReader, mine: np.ndarray, epochs: np.ndarray) -> np.ndarray:
        """Which DELIVER_ITEM rows of one source can be served: a piece must lie within its
        document, and a record that is not memory-mapped must be in the cache."""
        keys, offsets = mine[:, DELIVER_ITEM.doc_key], mine[:, DELIVER_ITEM.offset]
        lengths = mine[:, DELIVER_ITEM.length]
        if reader.memory_mapped:  # checked against the index
            ok = offsets + lengths <= reader.lengths(split_doc_key(keys)[1]).astype(np.uint64)
        else:
            ok = np.array([(e := self.cache.get(_cache_key(key, ep))) is not None and off + n <= e.length
                           for key, ep, off, n in zip(keys.tolist(), epochs.tolist(), offsets.tolist(),
                                                      lengths.tolist())], dtype=bool)
        for key, ep, off, n in zip(keys[~ok].tolist(), epochs[~ok].tolist(), offsets[~ok].tolist(),
                                   lengths[~ok].tolist()):
            entry = self.cache.get(_cache_key(key, ep)) if not reader.memory_mapped else None
            why = ("beyond its document" if reader.memory_mapped else
                   "not prepared here" if entry is None else f"beyond its document of {entry.length} tokens")
            log.error("step %d: piece %x[%d:+%d] cannot be served (%s); not sent", step, key, off, n, why)
        return ok

    def _read_pieces(self, step: int, items: np.ndarray, epochs: np.ndarray) -> DeliveryPieces:
        """The tokens (views into memory maps, or slices of cached records), loss mask and image
        patches of every DELIVER_ITEM row that can be served, read source by source."""
        sources = split_doc_key(items[:, DELIVER_ITEM.doc_key])[0]
        pieces = DeliveryPieces(items, sources)
        for s in np.unique(sources).tolist():
            self.keep_alive()
            at = np.flatnonzero(sources == s)
            reader = self._reader(s)
            at = at[self._servable(step, reader, items[at], epochs[at])]
            if not len(at):
                continue
            pieces.servable[at] = True
            mine = items[at]
            keys, offsets = mine[:, DELIVER_ITEM.doc_key], mine[:, DELIVER_ITEM.offset]
            lengths = mine[:, DELIVER_ITEM.length]
            if reader.memory_mapped:  # views into the memory map: one copy when a rank's are joined
                views = reader.pieces(split_doc_key(keys)[1], offsets, lengths)
                for i, view, n in zip(at.tolist(), views, lengths.tolist()):
                    pieces.tokens[i], pieces.masks[i] = view, n
                continue
            for i, key, ep, off, n in zip(at.tolist(), keys.tolist(), epochs[at].tolist(), offsets.tolist(),
                                          lengths.tolist()):
                entry = self.cache[_cache_key(key, ep)]
                if entry.processed is not None and entry.processed.waiting:
                    self._finish_images(reader, entry, key)  # its image pass (it may zero the loss mask)
                pieces.tokens[i] = entry.tokens[off: off + n]
                if entry.loss_mask is not None:
                    pieces.masks[i] = entry.loss_mask[off: off + n]
                else:
                    pieces.masks[i] = n
                if entry.processed is not None:
                    pieces.add_extras(i, entry.processed, off, n)
                if entry.images is not None and off < len(entry.images):
                    images = entry.images[off: min(off + n, len(entry.images))]
                    pieces.patch_counts[i] = len(images)
                    pieces.images[i] = images
        return pieces

    def _finish_images(self, reader: SourceReader, entry: CacheEntry, key: int) -> None:
        """A planned processor sample's image pass, at its first delivery. One that fails goes
        blank with nothing to train on (its tokens are planned already), reported with DELIVERED."""
        self.keep_alive()  # a step's images take a while: heartbeats go on between them
        source, record = split_doc_key(np.array([key], np.uint64))
        self.on_sample(int(source[0]), int(record[0]), self.specs[int(source[0])].max_sample_s)
        try:
            failed = reader.finish(entry.processed, int(record[0]))
        finally:
            self.on_sample(int(source[0]), int(record[0]), 0.0)
        if failed is not None:
            reason, kind = failed
            log.warning("source %s: record delivered with nothing to train on: %s", reader.name, reason,
                        extra={"source": reader.name, "record": int(record[0])})
            self.delivery_failures.append([int(source[0]), int(record[0]), reason[:P.MAX_STR_LEN], kind])

    def connection_lost(self, why: str) -> list[Action]:
        """Messages to or from the coordinator were lost (session.LOST_MESSAGES): whatever we hold
        may be counted wrong by the coordinator's books, so start clean and register again."""
        if self.worker_id is not None:
            log.warning("worker %d: %s (%s); registering again", self.worker_id, LOST_MESSAGES, why)
        self.worker_id = None
        self.cache.clear()
        return [Forgotten()]

    def heartbeat(self, busy_s: float, backlog: int = 0, send_waits: int = 0) -> P.WorkerHeartbeat:
        return P.WorkerHeartbeat(worker_id=self.worker_id, cached_records=len(self.cache), busy_s=busy_s,
                                 backlog=backlog, send_waits=send_waits)
