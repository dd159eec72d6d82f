"""JSONL shards (.jsonl, .jsonl.gz, .jsonl.zst) with a cached line-offset index for direct access.

The index is built by one scan and saved beside the shard as `<shard>.msdidx.npy`, or under the
cache dir when the data dir is read-only or the job names one (`runtime.cache_dir`). It records the shard's size and
mtime and is rebuilt
when they change. Compressed streams cannot be seeked, so a compressed shard is decompressed once
into the same place (`<name>.msd.jsonl`) and read from there: disk traded for random access. With
`runtime.copies: seekable` the copy is written instead in the Zstandard seekable format
(`<name>.msd.seekable.zst`: independent frames of 64 KiB of text and a table of them; pyzstd), a
third of the plain size, and a record is read by decompressing the frames that hold it.

A shard may be a URL of an object store (storage.py). Its index is then kept in the cache dir
(and, where the source's `storage.share_indexes` allows, stored beside the shard as
`<url>.msdidx.npy` for other hosts and later jobs), stamped with the object's size and version
tag. A plain shard's lines are read by byte range, a task's lines fetched together (`prefetch`);
a compressed one is copied and decompressed into the bounded local cache (copies.py), and so
is a plain one whose source sets `storage.whole_objects`.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import mmap
import os
import tempfile
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable

import numpy as np
import zstandard

from msd_common.files import atomic_write, preallocate

from .copies import CopyCache, is_evicted
from .direct_io import DirectWriter, Seen, pump
from .errors import RecordError, SourceFormatError
from .storage import is_url, local_name, store_for

try:  # the newline scan in C (worker/_lines.c); optional, like the coordinator's
    from . import _lines
except ImportError:
    _lines = None

if TYPE_CHECKING:
    import pyzstd

log = logging.getLogger("msd.jsonl")

_CHUNK = 1 << 20  # read size: 16 MB reads made decompression and the line scan ~1.8x slower (cache misses)
# Seekable copies: a record read decompresses the frames holding it (64 KiB frames: ~90 us a
# record, 0.33 of the plain size at level 1; 256 KiB frames: 170 us, 0.31; level 3: 10 % slower
# to write for 0.31). An open reader holds ~290 KB (its decompression context and buffers), so a
# process keeps the few last used open, not one per shard.
SEEKABLE_FRAME = 64 << 10
SEEKABLE_LEVEL = 1
OPEN_SEEKABLE = 8
COPY_SUFFIXES = {"plain": ".msd.jsonl", "seekable": ".msd.seekable.zst"}
_SAMPLE = 1 << 16  # bytes of a chunk whose newlines choose how the chunk is scanned
INDEX_SUFFIX = ".msdidx.npy"


def default_cache_dir() -> str:
    return os.environ.get("MSD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megascale-data")


def _sidecar_path(shard: str, suffix: str, cache_dir: str | None) -> str:
    """In the cache dir when one is given (the job's `runtime.cache_dir`), under a hash of the
    shard's path; else beside the data when that dir is writable, else in the default cache dir.
    A remote shard's are always in a cache dir."""
    if is_url(shard):
        directory = cache_dir or default_cache_dir()
        os.makedirs(directory, exist_ok=True)
        return os.path.join(directory, local_name(shard, suffix))
    shard_dir = os.path.dirname(os.path.abspath(shard))
    if cache_dir is None:
        if os.access(shard_dir, os.W_OK):
            return shard + suffix
        cache_dir = default_cache_dir()
    digest = hashlib.sha1(os.path.abspath(shard).encode()).hexdigest()[:16]
    os.makedirs(cache_dir, exist_ok=True)
    return os.path.join(cache_dir, f"{digest}-{os.path.basename(shard)}{suffix}")


SYNCED_SUFFIX = ".synced"  # beside a decompressed copy: the copy reached the disk (fsync)


def boot_time_ns() -> int | None:
    """When this machine booted (Linux: /proc/stat), or None where that is not known."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return int(line.split()[1]) * 10**9
    except (OSError, ValueError):
        pass
    return None


def _copy_usable(plain: str, shard: str) -> bool:
    """A decompressed copy is used if it is newer than its shard and cannot have lost data in a
    crash: it was synced to disk (its marker), or it was written since the machine booted (pages
    not yet on disk are in the page cache: only a reboot loses them)."""
    try:
        st = os.stat(plain)
        if st.st_mtime < os.path.getmtime(shard):
            return False
    except FileNotFoundError:
        return False
    try:
        if os.stat(plain + SYNCED_SUFFIX).st_mtime_ns >= st.st_mtime_ns:
            return True
    except FileNotFoundError:
        pass
    boot = boot_time_ns()
    return boot is not None and st.st_mtime_ns > boot


def mark_synced(plain: str) -> None:
    """Flush a copy written without fsync to the disk, then say so beside it (unless the copy
    was removed or replaced meanwhile)."""
    try:
        fd = os.open(plain, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
        synced = os.fstat(fd)
    finally:
        os.close(fd)
    try:
        now = os.stat(plain)
    except FileNotFoundError:
        return
    if (now.st_ino, now.st_mtime_ns) == (synced.st_ino, synced.st_mtime_ns):
        atomic_write(plain + SYNCED_SUFFIX, b"")


def copy_path(shard: str, cache_dir: str | None, copies: str = "plain") -> str | None:
    """Where the readable copy of a compressed local shard goes (None for a plain shard)."""
    if shard.endswith(".jsonl") or is_url(shard):
        return None
    return _sidecar_path(shard, COPY_SUFFIXES[copies], cache_dir)


def _local_copy(shard: str, cache_dir: str | None, durable: bool = True,
                copies: str = "plain") -> tuple[str, np.ndarray | None, bool]:
    """(path of a readable copy of `shard`: the shard itself when it is not compressed; its line
    offsets if the copy was written now, found in the same pass; whether it still has to be
    synced to disk). copies: "plain" (decompressed) or "seekable" (the Zstandard seekable
    format). durable=False where the caller syncs the copy later (mark_synced) and the boot time
    tells a copy that may have lost data in a crash: writing 4x the compressed bytes and then
    waiting for the disk was most of a cold start."""
    if shard.endswith(".jsonl"):
        return shard, None, False
    _check_suffix(shard)
    copy = copy_path(shard, cache_dir, copies)
    if _copy_usable(copy, shard) and (copies == "plain" or _seekable_intact(copy)):
        return copy, None, False
    try:
        os.unlink(copy + SYNCED_SUFFIX)  # it vouched for the old copy
    except FileNotFoundError:
        pass
    defer = not durable and boot_time_ns() is not None
    scan = _LineScan()

    def write_copy(out: BinaryIO) -> None:
        if copies == "plain":
            preallocate(out, _declared_size(shard))
        _write_copy(out, copies == "seekable", lambda to: decompress(shard, shard, to, scan.feed))

    atomic_write(copy, write_copy, durable=not defer)
    if not defer:
        atomic_write(copy + SYNCED_SUFFIX, b"")
    return copy, scan.offsets(), defer


def _write_copy(out: BinaryIO, seekable: bool, write: Any) -> None:
    """Write a copy into `out`: `write(to)` writes the text to `to` (decompress), a file that
    cuts it into seekable frames, or one that writes the plain text past the page cache
    (DirectWriter: docs/BENCHMARKS.md, Cold start)."""
    if seekable:
        _write_seekable(out, write)
        return
    with DirectWriter(out) as direct:
        write(direct)


def _write_seekable(out: BinaryIO, write: Any) -> None:
    """Write a seekable copy into `out`: `write(frames)` writes the text to a file that cuts it
    into frames and ends it with their table."""
    import pyzstd  # here: 1.4 MB of imports every process would hold for an option

    with pyzstd.SeekableZstdFile(out, "w", level_or_option=SEEKABLE_LEVEL,
                                 max_frame_content_size=SEEKABLE_FRAME) as frames:
        write(frames)


def _seekable_intact(path: str) -> bool:
    """A seekable copy ends with its frame table (a copy cut short by a crash has none)."""
    import pyzstd

    try:
        pyzstd.SeekableZstdFile(path, "r").close()
        return True
    except (OSError, EOFError, pyzstd.SeekableFormatError, pyzstd.ZstdError):
        return False


class _SeekableReaders:
    """The seekable copies this process reads, the OPEN_SEEKABLE last used kept open. A copy is
    named by its path and its file's identity (device, inode) when its index was read: a plain
    copy's reader keeps its file open for good, but a reader closed here and opened again by
    path would find a copy written anew since (its shard changed) and read it with the old index."""

    def __init__(self) -> None:
        # (path, identity) -> reader, least recently used first
        self._open: dict[tuple[str, tuple[int, int]], pyzstd.SeekableZstdFile] = {}

    def read(self, path: str, identity: tuple[int, int], start: int, size: int) -> bytes:
        import pyzstd

        key = (path, identity)
        reader = self._open.pop(key, None)
        if reader is None:
            while len(self._open) >= OPEN_SEEKABLE:
                self._open.pop(next(iter(self._open))).close()
            reader = pyzstd.SeekableZstdFile(path, "r")
            st = os.fstat(reader.fileno())
            if (st.st_dev, st.st_ino) != identity:
                reader.close()
                raise RecordError(f"{path}: the copy was written anew while in use (its shard changed?)")
        self._open[key] = reader
        reader.seek(start)
        return reader.read(size)


_seekable_readers = _SeekableReaders()


def _declared_size(shard: str) -> int:
    """The decompressed size a .zst shard's first frame declares (zstd writes it whenever it knows
    the input's size): the whole copy's size for a one-frame shard, less for more frames, never
    more. -1 where it is not known (gzip, a frame without it, not zstd at all: decompress says
    what is wrong)."""
    if not shard.endswith(".zst"):
        return -1
    try:
        with open(shard, "rb") as f:
            return zstandard.frame_content_size(f.read(18))  # 18: the longest frame header
    except (OSError, zstandard.ZstdError):
        return -1


def _check_suffix(shard: str) -> None:
    if not shard.endswith((".jsonl", ".jsonl.gz", ".jsonl.zst")):
        raise SourceFormatError(f"{shard}: not a .jsonl, .jsonl.gz or .jsonl.zst file")


def decompress(path: str, name: str, out: BinaryIO | DirectWriter, seen: Seen | None = None) -> None:
    """Decompress the file at `path` (the shard `name`, by its suffix) into `out`: a file, or a
    DirectWriter (then straight into its buffers). `seen(buffer, start, end)` is shown each piece
    of text first (the line scan of a copy written in the same pass)."""
    try:
        if name.endswith(".jsonl.gz"):
            with gzip.open(path, "rb") as src:  # a truncated stream raises EOFError
                _fill(out, src.readinto, seen)
        else:
            _copy_zstd(path, out, name, seen)
    except (OSError, EOFError, zstandard.ZstdError) as e:
        raise SourceFormatError(f"{name}: cannot decompress: {e}") from None


def _fill(out: BinaryIO | DirectWriter, readinto: Any, seen: Seen | None) -> None:
    if isinstance(out, DirectWriter):
        out.fill_from(readinto, seen)
    else:
        pump(readinto, out.write, seen, _CHUNK)


def _copy_zstd(shard: str, out: BinaryIO | DirectWriter, name: str | None = None, seen: Seen | None = None) -> None:
    """Decompress every frame of a zstd file into `out`. Its reader says nothing when the stream
    ends inside a frame (it returns what it has: a truncated shard would be read short, its lost
    records never named), so the frames are then walked to their ends (their block headers, not
    their contents: ~1 ms for 25 MB) and a cut one is an error."""
    with open(shard, "rb") as src:
        reader = zstandard.ZstdDecompressor().stream_reader(src, read_size=_CHUNK, read_across_frames=True)
        _fill(out, reader.readinto, seen)
    _check_frames_whole(shard, name)


def _check_frames_whole(shard: str, name: str | None) -> None:
    import pyzstd  # here: only a process that decompresses a zstd shard holds its 1.3 MB

    with open(shard, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data, memoryview(data) as view:
            at = 0
            while at < size:
                try:
                    at += pyzstd.get_frame_size(view[at:])
                except pyzstd.ZstdError:
                    raise SourceFormatError(f"{name or shard}: cannot decompress: the zstd stream ends inside a "
                                            f"frame at byte {at} of {size} (truncated file?)") from None


def _newlines(chunk: bytes | bytearray | mmap.mmap, start: int = 0, end: int | None = None) -> np.ndarray:
    """Positions (from `start`) of the newlines in chunk[start:end]: one memchr per line, in C
    (worker/_lines.c) where it is built, else in Python and numpy."""
    end = len(chunk) if end is None else end
    if _lines is not None:
        return np.frombuffer(_lines.newlines(chunk, start, end), np.int64)
    return _newlines_py(chunk, start, end)


def _newlines_py(chunk: bytes | bytearray | mmap.mmap, start: int, end: int) -> np.ndarray:
    """The reference of _lines.newlines. Documents are mostly long lines: then a memchr per line
    (find) beats comparing every byte in numpy; for short lines the numpy scan wins. Which one is
    told by the first 64 KiB: counting the whole chunk first (bytes.count does not use memchr:
    ~1.5 GB/s) took four times as long as the scan it chose (109 MB of ~2 KB lines: 80 ms against
    15 ms for the find loop alone, 25 ms for numpy)."""
    sample = min(end - start, _SAMPLE)
    if np.count_nonzero(np.frombuffer(chunk, np.uint8, sample, start) == 10) > sample >> 8:  # lines under 256 bytes
        return np.flatnonzero(np.frombuffer(chunk, np.uint8, end - start, start) == 10).astype(np.int64)
    found, find = [], chunk.find
    pos = find(b"\n", start, end)
    while pos >= 0:
        found.append(pos)
        pos = find(b"\n", pos + 1, end)
    return np.array(found, dtype=np.int64) - start


def _scan_offsets(path: str, seekable: bool = False) -> np.ndarray:
    """Start offset of every line, plus the end of the file (a final line without newline counts);
    of the text, for a seekable copy."""
    if seekable:
        import pyzstd

        opened: BinaryIO = pyzstd.SeekableZstdFile(path, "r")
    else:
        opened = open(path, "rb")
    scan = _LineScan()
    with opened as f:
        pump(f.readinto, lambda _: None, scan.feed, _CHUNK)
    return scan.offsets()


def _scan_chunks(chunks: Iterable[bytes]) -> np.ndarray:
    scan = _LineScan()
    for chunk in chunks:
        scan.feed(chunk)
    return scan.offsets()


class _LineScan:
    """Line offsets of a stream of chunks, fed one by one."""

    def __init__(self) -> None:
        self._starts = [np.zeros(1, np.int64)]
        self._size = 0

    def feed(self, chunk: bytes | bytearray | mmap.mmap, start: int = 0, end: int | None = None) -> None:
        """Scan chunk[start:end], the next bytes of the stream."""
        end = len(chunk) if end is None else end
        self._starts.append(_newlines(chunk, start, end) + self._size + 1)
        self._size += end - start

    def offsets(self) -> np.ndarray:
        offsets = np.concatenate(self._starts)
        if offsets[-1] != self._size:  # last line lacks a newline
            offsets = np.append(offsets, self._size)
        return offsets


class JsonlShard:
    """Line-addressable view of one JSONL shard (a local path or a URL)."""

    def __init__(self, shard: str, cache_dir: str | None = None, storage: dict[str, Any] | None = None,
                 cache_bytes: int | None = None, durable_copy: bool = True, copies: str = "plain") -> None:
        """durable_copy=False: a decompressed copy written here is not synced to disk; its path is
        left in `unsynced_copy` for the caller to pass to mark_synced (indexing.build_indexes).
        copies: how a compressed local shard's copy is kept (runtime.copies: plain, seekable)."""
        self.shard = shard
        self.unsynced_copy: str | None = None
        self._fd: int | None = None
        self._prefetched: dict[int, bytes] = {}
        self.seekable = False
        if is_url(shard):
            self._open_remote(cache_dir, storage, cache_bytes, copies)
            return
        if not os.path.isfile(shard):
            raise SourceFormatError(f"{shard}: file not found")
        self._store = None
        self.path, found, unsynced = _local_copy(shard, cache_dir, durable_copy, copies)
        self.seekable = self.path.endswith(COPY_SUFFIXES["seekable"])
        if unsynced:
            self.unsynced_copy = self.path
        st = os.stat(self.path)
        self._identity = (st.st_dev, st.st_ino)  # of the copy the index below describes
        stamp = np.array([st.st_size, st.st_mtime_ns], np.int64)
        # Lines are read with pread, not through a memory map: a worker touches a few lines of
        # many shards, and mapped pages would count in its resident memory (shared page cache).
        self.offsets = self._load_index(_sidecar_path(shard, INDEX_SUFFIX, cache_dir), stamp,
                                        (lambda: found) if found is not None else (lambda: _scan_offsets(self.path,
                                                                                                         self.seekable)))

    def _open_remote(self, cache_dir: str | None, storage: dict[str, Any] | None, cache_bytes: int | None,
                     copies: str = "plain") -> None:
        _check_suffix(self.shard)
        self._store = store = store_for(self.shard, storage)
        try:
            size, tag = store.stamp(self.shard)
        except FileNotFoundError:
            raise SourceFormatError(f"{self.shard}: object not found") from None
        except OSError as e:
            raise SourceFormatError(f"{self.shard}: cannot read ({e})") from None
        # read from a local copy: a compressed shard (no random access), or any with whole_objects
        self.copied = not self.shard.endswith(".jsonl") or store.whole_objects
        # a compressed shard's copy in the seekable format (runtime.copies): a third of the bytes
        # in the bounded cache, so about three times the shards fit before one is evicted
        self.seekable = self.copied and not self.shard.endswith(".jsonl") and copies == "seekable"
        self._seekable_at: str | None = None  # where the seekable copy was last found
        self._copies = CopyCache(cache_dir or default_cache_dir(), cache_bytes)
        self._copy_name = local_name(self.shard, ".seekable.zst" if self.seekable else ".jsonl", tag)
        self.path = self.shard
        stamp = np.array([size, tag], np.int64)
        build = (lambda: _scan_offsets(self._copy(), self.seekable)) if self.copied else (
            lambda: _scan_chunks(store.chunks(self.shard)))
        self.offsets = self._load_index(_sidecar_path(self.shard, INDEX_SUFFIX, cache_dir), stamp, build,
                                        shared=self.shard + INDEX_SUFFIX)

    def _load_index(self, index_path: str, stamp: np.ndarray, build, shared: str | None = None) -> np.ndarray:
        """The saved index if its stamp matches, else one found beside a remote shard, else built."""
        if os.path.exists(index_path):
            try:
                saved = np.load(index_path, mmap_mode="r")
                if saved.dtype == np.int64 and len(saved) >= 3 and np.array_equal(saved[:2], stamp):
                    return saved[2:]
            except (ValueError, OSError):
                pass  # unreadable index: rebuild it below
        if shared is not None:
            offsets = self._shared_index(shared, stamp)
            if offsets is not None:
                atomic_write(index_path, lambda f: np.save(f, np.concatenate([stamp, offsets])))
                return offsets
        offsets = build()
        data = np.concatenate([stamp, offsets])
        atomic_write(index_path, lambda f: np.save(f, data))
        if shared is not None and self._store.share_indexes:
            try:
                buf = io.BytesIO()
                np.save(buf, data)
                self._store.put(shared, buf.getvalue())
            except OSError as e:  # a read-only bucket: every host builds its own
                log.warning("%s: cannot store the index beside the shard (%s); it stays in the local cache", shared, e)
        return offsets

    def _shared_index(self, url: str, stamp: np.ndarray) -> np.ndarray | None:
        try:
            if not self._store.exists(url):
                return None
            saved = np.load(io.BytesIO(self._store.read(url, 0, self._store.stamp(url)[0])))
        except (OSError, ValueError) as e:
            log.warning("%s: shared index unreadable (%s); building one", url, e)
            return None
        if saved.dtype == np.int64 and len(saved) >= 3 and np.array_equal(saved[:2], stamp):
            return saved[2:]
        return None  # stale: built for an earlier version of the shard

    def _copy(self) -> str:
        """The local (decompressed) copy of a remote shard (fetched into the cache if it is not
        there)."""
        def make(out: BinaryIO) -> None:
            if self.shard.endswith(".jsonl"):
                self._store.download(self.shard, out)
                return
            with tempfile.NamedTemporaryFile(dir=self._copies.directory, suffix=".download") as raw:
                self._store.download(self.shard, raw)
                raw.flush()
                _write_copy(out, self.seekable, lambda to: decompress(raw.name, self.shard, to))
        return self._copies.path(self._copy_name, make)

    def _seekable_copy(self) -> tuple[str, tuple[int, int]]:
        """The seekable copy to read and the identity of its file. A remote shard's is fetched
        again when it was evicted, and any file at its path will do: its name holds the object's
        version tag."""
        if self._store is None:
            return self.path, self._identity
        try:
            st = os.stat(self._seekable_at or "")
            self._copies.touch(self._seekable_at)
        except FileNotFoundError:  # not fetched yet, or evicted by another process
            self._seekable_at = self._copy()
            st = os.stat(self._seekable_at)
        return self._seekable_at, (st.st_dev, st.st_ino)

    def _read_seekable(self, start: int, size: int) -> bytes:
        try:
            return _seekable_readers.read(*self._seekable_copy(), start, size)
        except FileNotFoundError:  # evicted between the look and the open: fetched again, once
            self._seekable_at = None
            return _seekable_readers.read(*self._seekable_copy(), start, size)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def prefetch(self, lines: Iterable[int]) -> None:
        """Fetch these lines of a remote plain shard in as few requests as their places allow
        (a prepare task's records); a line that fails here is fetched again, alone, when read."""
        self._prefetched = {}
        if self._store is None or self.copied:
            return
        lines = sorted(set(lines))
        try:
            blobs = self._store.fetch(self.shard, [int(self.offsets[i]) for i in lines],
                                      [int(self.offsets[i + 1]) for i in lines])
        except OSError as e:
            log.warning("%s: prefetch of %d lines failed (%s); reading them one by one", self.shard, len(lines), e)
            return
        self._prefetched = dict(zip(lines, blobs))

    def line(self, i: int) -> bytes:
        """Bytes of line i (0-based), without its newline."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        raw = self._prefetched.pop(i, None)
        if raw is None:
            if self._store is not None and not self.copied:
                raw = self._store.read(self.shard, start, end)
            elif self.seekable:
                raw = self._read_seekable(start, end - start)
            else:
                raw = os.pread(self._open(), end - start, start)
        if len(raw) != end - start:
            raise RecordError(f"{self.shard}:{i + 1}: file shorter than its index says (changed while in use?)")
        return raw[:-1] if raw.endswith(b"\n") else raw

    def close(self) -> None:
        """Close the shard's file (opened again on the next read)."""
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)

    # A reader dropped (a worker's sources opened again at each welcome: a coordinator restarted, a
    # lost connection) closes its file: an int descriptor is not closed by the collector, and a
    # worker that registered again thousands of times ran out of them (found by msd.sim).
    __del__ = close

    def _open(self) -> int:
        if self._store is None:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_RDONLY)
            return self._fd
        if self._fd is not None and is_evicted(self._fd):  # another process made room in the cache
            os.close(self._fd)
            self._fd = None
        if self._fd is None:
            path = self._copy()
            self._fd = os.open(path, os.O_RDONLY)
            self._copy_path = path
        else:
            self._copies.touch(self._copy_path)
        return self._fd
