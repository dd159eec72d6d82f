"""Where shards live: local paths, or URLs of object stores (`s3://`, `gs://`, `az://`, ...) read
through fsspec's file systems.

A source's `storage:` block (job file) holds the options of its file system (an endpoint, a
region, a profile: never secrets, which come from each store's standard environment) and three
of ours: `max_retries`, `share_indexes` and `whole_objects`. Every request to a store goes through `Store.retry`:
a transient error (timeout, 5xx, throttling: anything but a missing object, a refused
permission or a bad argument) is retried with exponential back-off and jitter, up to
`max_retries` times, and only then raised, naming the URL.

Reads of a task are coalesced (`Store.fetch`): byte ranges that lie near each other in one
object are fetched in one request, and the requests of a task go out concurrently. For s3://
the ranged reads (the hot path) go through obstore (Rust's object_store) when it is installed
and the storage block holds nothing it cannot take: measured here at three times the requests
per second of s3fs for the same CPU (docs/BENCHMARKS.md); so do listing and metadata, so that a
worker process reading Megatron or JSONL shards never imports s3fs and botocore (a second of CPU
per process at start-up); Parquet files and index uploads stay with fsspec.
`MSD_STORAGE_RANGES=fsspec` turns the fast path off.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import logging
import os
import random
import re
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from .errors import SourceFormatError

if TYPE_CHECKING:  # asyncio is imported where an object store is read (15 ms of every reader's start-up)
    import asyncio

log = logging.getLogger("msd.storage")

T = TypeVar("T")

# Keys of a storage block that would put a secret into the job file.
SECRET_KEYS = frozenset({
    "key", "secret", "token", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token",
    "access_key", "secret_key", "session_token", "account_key", "sas_token", "connection_string", "client_secret",
    "credentials",
})
OUR_KEYS = ("max_retries", "share_indexes", "whole_objects")
DEFAULT_MAX_RETRIES = 8
BACKOFF_FIRST_S = 0.1
BACKOFF_CAP_S = 5.0
COALESCE_GAP = 8 << 10  # ranges this close are fetched in one request (the gap is read and dropped; at
# 64 KiB, a task of random documents of a few KB read 1.5 bytes per byte it needed)
COALESCE_MAX = 8 << 20  # but one request stays under this size
DOWNLOAD_AT_ONCE = 8  # requests of a whole-object copy in flight together (64 MiB buffered)
# The extra packages that serve each store (pip install megascale-data[s3] etc.).
EXTRAS = {"s3": "s3 (s3fs)", "s3a": "s3 (s3fs)", "gs": "gcs (gcsfs)", "gcs": "gcs (gcsfs)", "az": "azure (adlfs)",
          "abfs": "azure (adlfs)", "abfss": "azure (adlfs)"}

# Called while a request waits to be retried: a worker sets it to its heartbeat, so that a
# worker waiting out a throttled store is not taken for dead.
keep_alive: Callable[[], None] = lambda: None


def is_url(path: str) -> bool:
    """A path of an object store (anything with a scheme but file://)."""
    return "://" in path and not path.startswith("file://")


def protocol_of(url: str) -> str:
    return url.split("://", 1)[0].lower()


def options_of(storage: dict[str, Any] | None) -> dict[str, Any]:
    """The file system's own options of a storage block (ours removed)."""
    return {k: v for k, v in (storage or {}).items() if k not in OUR_KEYS}


class Store:
    """One object store's file system, with retries and a count of the bytes fetched."""

    def __init__(self, protocol: str, storage: dict[str, Any] | None = None) -> None:
        self.protocol = protocol
        self.max_retries = int((storage or {}).get("max_retries", DEFAULT_MAX_RETRIES))
        self.share_indexes = bool((storage or {}).get("share_indexes", False))
        self.whole_objects = bool((storage or {}).get("whole_objects", False))
        self._options = options_of(storage)
        self.bytes_fetched = 0
        self.requests = 0
        self.retries = 0
        self._fast = FastRanges.make(protocol, storage)
        if self._fast is None:
            self.fs  # noqa: B018 - made now, so that a missing package or a bad option is named at start-up

    @functools.cached_property
    def fs(self) -> Any:
        """The store's fsspec file system. Where obstore serves the store (FastRanges), it is made
        only for what obstore does not do here (Parquet files, index uploads): importing s3fs and
        botocore costs each process about a second of CPU at start-up."""
        import fsspec

        try:
            # not fsspec's instance cache: it keys on arguments alone, and the store's environment
            # (endpoint, credentials) is part of what a Store is here (store_for)
            # (its import takes a second of CPU or more on a busy host: the heartbeat goes on)
            return waited(lambda: fsspec.filesystem(self.protocol, skip_instance_cache=True, **self._options))
        except ImportError as e:
            extra = EXTRAS.get(self.protocol)
            hint = f"pip install 'megascale-data[{extra.split()[0]}]' ({extra})" if extra else str(e)
            raise SourceFormatError(f"{self.protocol}:// URLs need a file system that is not installed: {hint}") \
                from None
        except (ValueError, TypeError) as e:
            raise SourceFormatError(f"{self.protocol}:// storage options refused by its file system: {e}") from None

    def retry(self, what: str, call: Callable[[], T]) -> T:
        """`call()`, retried on transient errors with back-off and jitter; the last error is raised
        as OSError naming `what` (a URL)."""
        for attempt in range(self.max_retries + 1):
            try:
                return call()
            except Exception as e:  # noqa: BLE001 - sorted into transient and final just below
                if not _transient(e) or attempt == self.max_retries:
                    if isinstance(e, (FileNotFoundError, PermissionError)):
                        raise type(e)(f"{what}: {e}") from None
                    raise OSError(f"{what}: {type(e).__name__}: {e}" +
                                  (f" (after {attempt} retries)" if attempt else "")) from None
                self.retries += 1
                delay = min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** attempt) * random.uniform(0.5, 1.5)
                log.info("%s: %s: %s; retrying in %.2f s (%d of %d)", what, type(e).__name__, e, delay, attempt + 1,
                         self.max_retries)
                _sleep(delay)
        raise AssertionError("unreachable")

    def glob(self, pattern: str) -> list[str]:
        """Sorted URLs of the objects a pattern matches (fsspec's glob rules)."""
        if self._fast is not None:
            return self.retry(pattern, lambda: self._fast.glob(pattern))
        found = self.retry(pattern, lambda: waited(lambda: self.fs.glob(pattern, detail=True)))
        return sorted(self.fs.unstrip_protocol(p) for p, info in found.items() if info.get("type") != "directory")

    def exists(self, url: str) -> bool:
        try:
            self.info(url)
            return True
        except FileNotFoundError:
            return False

    def info(self, url: str) -> dict[str, Any]:
        """The object's metadata: at least its size, and an ETag or a modification time."""
        if self._fast is not None:
            return self.retry(url, lambda: self._fast.head(url))
        return self.retry(url, lambda: waited(lambda: self.fs.info(url)))

    def stamp(self, url: str) -> tuple[int, int]:
        """(size, version tag) of an object: the tag changes when the object is rewritten (its ETag,
        else its modification time), so that an index built for it can be checked."""
        info = self.info(url)
        tag = str(info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime")
                  or info.get("last_modified") or "")
        return int(info["size"]), int.from_bytes(hashlib.sha1(tag.encode()).digest()[:7], "little")

    def fetch(self, url: str, starts: list[int], ends: list[int]) -> list[bytes]:
        """Bytes [start, end) of each range of one object, in the order given: nearby ranges in one
        request, the requests at once; each checked for length."""
        if not starts:
            return []
        order = sorted(range(len(starts)), key=starts.__getitem__)
        groups: list[list[int]] = []  # merged requests, as indices into starts/ends
        for i in order:
            if groups:
                g = groups[-1]
                lo, hi = starts[g[0]], max(ends[j] for j in g)
                if starts[i] <= hi + COALESCE_GAP and max(hi, ends[i]) - lo <= COALESCE_MAX:
                    g.append(i)
                    continue
            groups.append([i])
        g_starts = [starts[g[0]] for g in groups]
        g_ends = [max(ends[j] for j in g) for g in groups]
        blobs = self._ranges(url, g_starts, g_ends)
        out: list[bytes] = [b""] * len(starts)
        for g, lo, blob in zip(groups, g_starts, blobs):
            for i in g:
                out[i] = blob[starts[i] - lo: ends[i] - lo]
        return out

    def _ranges(self, url: str, starts: list[int], ends: list[int]) -> list[bytes]:
        """Whole ranges, concurrently; the ranges that failed (or came back short) are asked again
        until the retries run out."""
        out: list[bytes | None] = [b"" if e <= s else None for s, e in zip(starts, ends)]
        todo = [i for i, blob in enumerate(out) if blob is None]
        if not todo:
            return out  # type: ignore[return-value]
        for attempt in range(self.max_retries + 1):
            if self._fast is not None:
                got = self._fast.get(url, [starts[i] for i in todo], [ends[i] for i in todo])
            else:
                got = waited(lambda: self.fs.cat_ranges([url] * len(todo), [starts[i] for i in todo],
                                                         [ends[i] for i in todo], on_error="return"))
            self.requests += len(todo)
            failed, last = [], None
            for i, blob in zip(todo, got):
                if isinstance(blob, bytes) and len(blob) == ends[i] - starts[i]:
                    out[i] = blob
                    self.bytes_fetched += len(blob)
                    continue
                error = blob if isinstance(blob, BaseException) else OSError(
                    f"short read: {len(blob)} of {ends[i] - starts[i]} bytes")
                if isinstance(blob, bytes):
                    self.bytes_fetched += len(blob)
                if not _transient(error):
                    raise OSError(f"{url} bytes {starts[i]}-{ends[i]}: {type(error).__name__}: {error}")
                failed.append(i)
                last = error
            if not failed:
                return out  # type: ignore[return-value]
            if attempt == self.max_retries:
                raise OSError(f"{url}: {type(last).__name__}: {last} (after {attempt} retries)")
            self.retries += len(failed)
            delay = min(BACKOFF_CAP_S, BACKOFF_FIRST_S * 2 ** attempt) * random.uniform(0.5, 1.5)
            log.info("%s: %d of %d ranges failed (%s); retrying in %.2f s", url, len(failed), len(todo), last, delay)
            _sleep(delay)
            todo = failed
        raise AssertionError("unreachable")

    def read(self, url: str, start: int, end: int) -> bytes:
        return self.fetch(url, [start], [end])[0]

    def download(self, url: str, out: Any, chunk: int = COALESCE_MAX, at_once: int = DOWNLOAD_AT_ONCE) -> int:
        """Copy a whole object into the open binary file `out`, in ranged requests of `chunk` bytes,
        `at_once` of them concurrently (one stream is latency-bound; a request that fails is
        retried alone); returns its size."""
        size = self.stamp(url)[0]
        window = chunk * at_once
        for first in range(0, size, window):
            starts = list(range(first, min(size, first + window), chunk))
            for blob in self.fetch(url, starts, [min(size, s + chunk) for s in starts]):
                out.write(blob)
        return size

    def chunks(self, url: str, chunk: int = 16 << 20):
        """The object's bytes in order, in ranged requests (each retried alone)."""
        size = self.stamp(url)[0]
        for start in range(0, size, chunk):
            yield self.read(url, start, min(size, start + chunk))

    def put(self, url: str, data: bytes) -> None:
        self.retry(url, lambda: waited(lambda: self.fs.pipe_file(url, data)))


class FastRanges:
    """Ranged GETs through obstore, concurrently, on an event loop of this process's own (one
    request per range: obstore's get_ranges would merge ranges up to 1 MiB apart, reading far
    more than asked for)."""

    PROTOCOLS = ("s3", "s3a")

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self._stores: dict[str, Any] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0

    @classmethod
    def make(cls, protocol: str, storage: dict[str, Any] | None) -> "FastRanges | None":
        if protocol not in cls.PROTOCOLS or os.environ.get("MSD_STORAGE_RANGES") == "fsspec":
            return None
        try:
            import obstore  # noqa: F401
        except ImportError:
            return None
        options = dict(options_of(storage))
        client_kwargs = dict(options.pop("client_kwargs", None) or {})
        config: dict[str, Any] = {}
        endpoint = options.pop("endpoint_url", None) or client_kwargs.pop("endpoint_url", None)
        region = options.pop("region", None) or client_kwargs.pop("region_name", None)
        if options.pop("anon", False):
            config["skip_signature"] = True
        if options or client_kwargs:  # a profile, a session, ...: what only fsspec's client takes
            return None
        endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            config["endpoint"] = endpoint
        if region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION"):
            config["region"] = region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        return cls(config)

    def _store(self, bucket: str) -> Any:
        store = self._stores.get(bucket)
        if store is None:
            from obstore.store import S3Store

            client = {"allow_http": True} if str(self.config.get("endpoint", "")).startswith("http://") else None
            store = self._stores[bucket] = S3Store(bucket, config=self.config, client_options=client)
        return store

    def _run(self, coroutine) -> Any:
        import asyncio

        if self._loop is None or self._pid != os.getpid():  # (a forked worker makes its own)
            self._pid, self._stores = os.getpid(), {}
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, daemon=True, name="msd-storage").start()
        # obstore retries inside: a long wait keeps the worker's heartbeat going
        return _result_keeping_alive(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def _where(self, url: str) -> tuple[Any, str]:
        """(the bucket's store, the object's key) of a URL."""
        bucket, _, key = url.split("://", 1)[1].partition("/")
        return self._store(bucket), key

    def _ask(self, make: Callable[[], Any]) -> Any:
        """The result of the coroutine `make()` gives, run on this process's loop (obstore's
        coroutines start on the loop that awaits them), its errors raised as the built-in ones
        the retry rules know."""
        async def asked() -> Any:
            return await make()
        try:
            return self._run(asked())
        except Exception as e:  # noqa: BLE001 - sorted by _plain_error, then by the retry rules
            raise _plain_error(e) from None

    def head(self, url: str) -> dict[str, Any]:
        """Size and ETag (the keys fsspec's info gives them) of one object."""
        import obstore

        store, key = self._where(url)
        meta = self._ask(lambda: obstore.head_async(store, key))
        return {"size": meta["size"], "ETag": meta["e_tag"], "LastModified": meta["last_modified"]}

    def glob(self, pattern: str) -> list[str]:
        """Sorted URLs of the objects a pattern matches: the objects under the pattern's fixed
        directory, listed, and matched with fsspec's own translation of the pattern."""
        import obstore
        from fsspec.utils import glob_translate

        store, key_pattern = self._where(pattern)
        root = pattern[:len(pattern) - len(key_pattern)]  # scheme://bucket/
        wild = min((i for i in (key_pattern.find(c) for c in "*?[") if i >= 0), default=-1)
        if wild < 0:  # a plain key
            try:
                self.head(pattern)
                return [pattern]
            except FileNotFoundError:
                return []
        prefix = key_pattern[:wild].rpartition("/")[0] or None  # whole path segments only
        matches = re.compile(glob_translate(key_pattern)).match

        async def listing() -> list[str]:
            return [meta["path"] async for batch in obstore.list(store, prefix) for meta in batch]
        return sorted(root + k for k in self._ask(listing) if matches(k))

    def get(self, url: str, starts: list[int], ends: list[int]) -> list[bytes | BaseException]:
        import asyncio

        import obstore

        store, key = self._where(url)

        async def all_ranges() -> list:
            return await asyncio.gather(*(obstore.get_range_async(store, key, start=a, end=b)
                                          for a, b in zip(starts, ends)), return_exceptions=True)
        return [_plain_error(r) if isinstance(r, BaseException) else bytes(r) for r in self._run(all_ranges())]


def _plain_error(e: BaseException) -> BaseException:
    """obstore's errors as the built-in ones the retry rules know."""
    name = type(e).__name__
    if name == "NotFoundError":
        return FileNotFoundError(str(e))
    if name in ("PermissionDeniedError", "UnauthenticatedError"):
        return PermissionError(str(e))
    return e


_stores: dict[tuple[str, str, int], Store] = {}
ENV_PREFIXES = ("AWS_", "GOOGLE_", "GCS", "AZURE_", "FSSPEC_")


def store_for(url: str, storage: dict[str, Any] | None = None) -> Store:
    """The process's Store for a URL's protocol, storage block and store environment (endpoint,
    credentials: a change of them gives a new Store)."""
    import orjson

    env = hash(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))))
    key = (protocol_of(url), orjson.dumps(storage or {}, option=orjson.OPT_SORT_KEYS).decode(), env)
    store = _stores.get(key)
    if store is None:
        store = _stores[key] = Store(key[0], storage)
    return store


def totals() -> tuple[int, int, int]:
    """(bytes fetched, ranged requests, retries) of this process's reads from object stores."""
    stores = list(_stores.values())
    return (sum(s.bytes_fetched for s in stores), sum(s.requests for s in stores), sum(s.retries for s in stores))


def local_name(url: str, suffix: str, tag: int | None = None) -> str:
    """A file name for something derived from a remote object, in a flat cache directory."""
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]
    version = f"-{tag:x}" if tag is not None else ""
    return f"{digest}{version}-{os.path.basename(url.rstrip('/'))}{suffix}"


def _transient(e: BaseException) -> bool:
    """Worth asking again: not a missing object, a refused permission or a bad argument."""
    if isinstance(e, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ValueError,
                      TypeError, NotImplementedError, SourceFormatError)):
        return False
    return True


_waiter: tuple[int, concurrent.futures.ThreadPoolExecutor] | None = None  # (pid, its thread)
_on_waiter = threading.local()


def waited(call: Callable[[], T]) -> T:
    """`call()` run on a thread of this process's own while this one keeps the heartbeat going:
    a request to a stalled store (fsspec's calls block until it answers or times out) must not
    leave a worker silent for longer than the coordinator waits before declaring it dead."""
    global _waiter
    if getattr(_on_waiter, "yes", False):  # already there (a call inside a waited call): run it
        return call()
    if _waiter is None or _waiter[0] != os.getpid():  # (a forked worker makes its own)
        _waiter = (os.getpid(), concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="msd-store", initializer=lambda: setattr(_on_waiter, "yes", True)))
    return _result_keeping_alive(_waiter[1].submit(call))


def _result_keeping_alive(future: concurrent.futures.Future) -> Any:
    """The future's result (or its error), calling keep_alive while it is not done. Waited with
    wait(), not result(timeout): a call that itself raises TimeoutError must end the wait."""
    while not concurrent.futures.wait([future], timeout=0.25).done:
        keep_alive()
    return future.result()


def _sleep(seconds: float) -> None:
    """Sleep while keeping the process's heartbeat going."""
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        keep_alive()
        time.sleep(min(left, 0.25))
