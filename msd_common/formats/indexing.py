"""Building the indexes that random access needs (JSONL line offsets, decompressed copies of
compressed JSONL, WebDataset tar indexes) for many shards at once, with progress in the log.

A shard's index is built on first open and cached (jsonl.py, webdataset.py); opened one shard
after another, a cold start of a large corpus was one core decompressing and scanning every
byte. Here the shards that have no index yet are built by a pool of processes (forked where the
caller has no other thread, as the coordinator at start-up, else spawned; the scan of long lines
is Python and would hold a thread pool to one core), so a host's cores share the work; on the
other hosts, by their worker processes, sharing the shards by a lock each (build_indexes_shared).
Megatron and Parquet sources carry their own indexes and are not touched here. Remote shards
(URLs) are indexed the same way, by streaming them once.
"""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from typing import TYPE_CHECKING, Any, Callable, Sequence

from . import jsonl, webdataset
from .storage import is_url, store_for

if TYPE_CHECKING:  # (the spec imports this floor's readers; only its type is needed here)
    from ..worker_job import SourceSpec

log = logging.getLogger("msd.indexing")

PROGRESS_EVERY_S = 5.0
_SHARD_TYPES = {"jsonl": jsonl.JsonlShard, "webdataset": webdataset.WebDatasetShard}
_INDEX_SUFFIXES = {"jsonl": jsonl.INDEX_SUFFIX, "webdataset": webdataset.INDEX_SUFFIX}


def _unindexed(spec: "SourceSpec") -> list[str]:
    """The shards of one source spec that have no index on this host (none for formats that need none)."""
    if spec.format not in _SHARD_TYPES:
        return []
    return [path for path in spec.files if not _looks_indexed(spec.format, path, spec.cache_dir, spec.copies)]


def _typed(specs: Sequence[Any]) -> list["SourceSpec"]:
    """Source specs as SourceSpec (a plain dict of a spec's fields is accepted, and checked)."""
    from ..worker_job import SourceSpec

    return [s if isinstance(s, SourceSpec) else SourceSpec.from_wire(s) for s in specs]


def _missing(specs: Sequence["SourceSpec"]) -> list[tuple]:
    """(format, shard, cache dir, storage, cache bytes, copies) of every shard of these specs with
    no index (or no copy) yet."""
    return [(spec.format, path, spec.cache_dir, spec.storage, spec.cache_bytes, spec.copies)
            for spec in _typed(specs) for path in _unindexed(spec)]


def unindexed_shards(specs: Sequence["SourceSpec"]) -> dict[int, list[str]]:
    """{position in specs: its shards with no index on this host} of the sources that have any."""
    return {i: missing for i, spec in enumerate(_typed(specs)) if (missing := _unindexed(spec))}


def build_indexes(specs: Sequence["SourceSpec"], processes: int | None = None,
                  meanwhile: Callable[[], object] | None = None) -> dict[str, str]:
    """Build and cache the index of every JSONL and WebDataset shard of these source specs that
    has none yet, `processes` at a time (default: the cores). meanwhile: called once the pool
    runs, with work of the caller's own that would otherwise wait for the indexing (the
    coordinator's imports). Returns {shard path: problem} for shards that could not be indexed;
    the caller reports them where it opens the source."""
    work = _missing(specs)
    if not work:
        return {}
    sizes = {w[1]: _size(w[1], w[3]) for w in work}
    total = sum(sizes.values())
    processes = min(processes or os.cpu_count() or 1, len(work))
    problems: dict[str, str] = {}
    unsynced: list[str] = []
    done = done_bytes = 0
    started = last_report = time.monotonic()
    # fork where this process has no other thread (the coordinator at start-up): a spawned pool
    # process imports numpy and the readers again first, a third of a small cold start
    method = "fork" if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods() else "spawn"
    pool = (ProcessPoolExecutor(max_workers=processes, mp_context=multiprocessing.get_context(method))
            if processes > 1 else ThreadPoolExecutor(max_workers=1))
    with pool:
        futures = {pool.submit(index_one, *w): w[1] for w in work}
        if meanwhile is not None:
            meanwhile()
        for future in as_completed(futures):
            path = futures[future]
            try:
                copy = future.result()
                if copy is not None:
                    unsynced.append(copy)
            except Exception as e:  # noqa: BLE001 - a bad shard, or a pool process lost: the open after this reports it
                problems[path] = str(e) or type(e).__name__
            done += 1
            done_bytes += sizes[path]
            now = time.monotonic()
            if now - last_report >= PROGRESS_EVERY_S and done < len(work):
                last_report = now
                rate = done_bytes / max(now - started, 1e-9)
                left = (total - done_bytes) / rate if rate > 0 else float("inf")
                log.info("indexing shards: %d of %d, %.2f of %.2f GB, %.0f MB/s, about %.0f s left",
                         done, len(work), done_bytes / 1e9, total / 1e9, rate / 1e6, left)
    seconds = time.monotonic() - started
    if seconds >= 1.0:
        log.info("indexed %d shards (%.2f GB) in %.1f s with %d processes", len(work), total / 1e9, seconds,
                 processes)
    sync_later(unsynced)
    return problems


def build_indexes_shared(specs: Sequence["SourceSpec"], keep_alive: Callable[[], None] = lambda: None,
                         first: int = 0) -> tuple[list[str], dict[str, str]]:
    """Build the missing indexes (and decompressed copies) of these specs in this process, sharing
    the work with the other processes of this host doing the same (the worker processes of a host
    the coordinator's start-up did not index for): a shard is built by the process that takes its
    lock first; the others go on to the next and then wait for it. `first`: where in the list
    this process starts (its worker id), so that the processes start apart. keep_alive is called
    between shards and while waiting. Returns (shards built here, {shard: problem})."""
    work = _missing(specs)
    if not work:
        return [], {}
    first %= len(work)
    built, problems, others = [], {}, []
    unsynced: list[str] = []
    for w in work[first:] + work[:first]:
        keep_alive()
        try:
            lock = open(_lock_path(w), "a+b")
        except OSError as e:  # no writable cache here: the open on first use builds it, or says why
            problems[w[1]] = f"cannot lock its index ({e})"
            continue
        with lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                others.append(w)  # another process builds it
                continue
            try:
                if not _looks_indexed(w[0], w[1], w[2], w[5]):
                    copy = index_one(*w)
                    built.append(w[1])
                    if copy is not None:
                        unsynced.append(copy)
            except Exception as e:  # noqa: BLE001 - the open on first use reports it again, by name
                problems[w[1]] = str(e) or type(e).__name__
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
    for w in others:  # wait until the process building it lets go
        with open(_lock_path(w), "a+b") as lock:
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    keep_alive()
                    time.sleep(0.1)
            fcntl.flock(lock, fcntl.LOCK_UN)
    if built:
        log.info("indexed %d shards of this host's %d missing ones", len(built), len(work))
    sync_later(unsynced)
    return built, problems


def _lock_path(work: tuple) -> str:
    """The lock file beside a shard's index (in its cache dir)."""
    return jsonl._sidecar_path(work[1], _INDEX_SUFFIXES[work[0]] + ".lock", work[2])


def index_one(fmt: str, path: str, cache_dir: str | None, storage: dict[str, Any] | None = None,
              cache_bytes: int | None = None, copies: str = "plain") -> str | None:
    """Build and cache one shard's index (and a compressed shard's copy) if it is missing or
    stale (in a pool process). Returns the path of a copy written without waiting for the disk
    (to be synced)."""
    if fmt == "jsonl":
        return jsonl.JsonlShard(path, cache_dir, storage, cache_bytes, durable_copy=False, copies=copies).unsynced_copy
    webdataset.WebDatasetShard(path, cache_dir, storage)
    return None


_syncs: list[threading.Thread] = []


def wait_for_syncs(timeout_s: float | None = None) -> bool:
    """Wait for the background syncs started in this process; True if none is left running."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    for thread in list(_syncs):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    _syncs[:] = [t for t in _syncs if t.is_alive()]
    return not _syncs


def sync_later(copies: list[str]) -> threading.Thread | None:
    """Flush these decompressed copies to disk in a background thread, marking each when done
    (jsonl.mark_synced): the job starts from the page cache meanwhile, and a copy whose marker is
    missing after a reboot is decompressed again."""
    if not copies:
        return None

    def run() -> None:
        started = time.monotonic()
        for path in copies:
            try:
                jsonl.mark_synced(path)
            except OSError as e:
                log.warning("%s: cannot sync the decompressed copy to disk (%s); after a reboot it is "
                            "decompressed again", path, e)
        log.info("decompressed copies of %d shards on disk, %.1f s after indexing", len(copies),
                 time.monotonic() - started)

    thread = threading.Thread(target=run, name="msd-sync-copies", daemon=True)
    thread.start()
    _syncs.append(thread)
    return thread


def _looks_indexed(fmt: str, path: str, cache_dir: str | None, copies: str = "plain") -> bool:
    """An index file newer than the shard exists, and so does a compressed JSONL shard's copy of
    the job's kind (a cheap guess: the open that follows checks the index properly, and rebuilds
    it if the guess was wrong). A remote shard's: any index in the cache (its stamp is checked at
    open, one request)."""
    if is_url(path):
        return os.path.exists(jsonl._sidecar_path(path, _INDEX_SUFFIXES[fmt], cache_dir))
    try:
        copy = jsonl.copy_path(path, cache_dir, copies) if fmt == "jsonl" else None
        if copy is not None and os.path.getmtime(copy) < os.path.getmtime(path):
            return False
        return os.path.getmtime(jsonl._sidecar_path(path, _INDEX_SUFFIXES[fmt], cache_dir)) >= os.path.getmtime(path)
    except OSError:
        return False


def _size(path: str, storage: dict[str, Any] | None) -> int:
    try:
        return store_for(path, storage).stamp(path)[0] if is_url(path) else os.path.getsize(path)
    except Exception:  # noqa: BLE001 - only for the progress figures; the open reports the problem
        return 0
