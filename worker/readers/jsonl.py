"""JSONL shards (.jsonl, .jsonl.gz, .jsonl.zst) with a cached line-offset index for direct access.

The index is built by one scan and saved beside the shard as `<shard>.msdidx.npy`, or under the
cache dir when the data dir is read-only or the job names one (`runtime.cache_dir`). It records the shard's size and mtime and is rebuilt
when they change. Compressed streams cannot be seeked, so a compressed shard is decompressed once
into the same place (`<name>.msd.jsonl`) and read from there: disk traded for random access.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import shutil

import numpy as np
import zstandard

from trainer_client.files import atomic_write

from .errors import RecordError, SourceFormatError

_CHUNK = 16 << 20
INDEX_SUFFIX = ".msdidx.npy"


def default_cache_dir() -> str:
    return os.environ.get("MSD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "megascale-data")


def _sidecar_path(shard: str, suffix: str, cache_dir: str | None) -> str:
    """In the cache dir when one is given (the job's `runtime.cache_dir`), under a hash of the
    shard's path; else beside the data when that dir is writable, else in the default cache dir."""
    shard_dir = os.path.dirname(os.path.abspath(shard))
    if cache_dir is None:
        if os.access(shard_dir, os.W_OK):
            return shard + suffix
        cache_dir = default_cache_dir()
    digest = hashlib.sha1(os.path.abspath(shard).encode()).hexdigest()[:16]
    os.makedirs(cache_dir, exist_ok=True)
    return os.path.join(cache_dir, f"{digest}-{os.path.basename(shard)}{suffix}")


def _plain_path(shard: str, cache_dir: str | None) -> str:
    """Path of an uncompressed copy of `shard` (the shard itself when it is not compressed)."""
    if shard.endswith(".jsonl"):
        return shard
    if shard.endswith(".jsonl.gz"):
        def decompress(out) -> None:
            with gzip.open(shard, "rb") as src:  # a truncated stream raises EOFError
                shutil.copyfileobj(src, out, _CHUNK)
    elif shard.endswith(".jsonl.zst"):
        def decompress(out) -> None:
            _copy_zstd(shard, out)
    else:
        raise SourceFormatError(f"{shard}: not a .jsonl, .jsonl.gz or .jsonl.zst file")
    plain = _sidecar_path(shard, ".msd.jsonl", cache_dir)
    if not os.path.exists(plain) or os.path.getmtime(plain) < os.path.getmtime(shard):
        def copy(out) -> None:
            try:
                decompress(out)
            except (OSError, EOFError, zstandard.ZstdError) as e:
                raise SourceFormatError(f"{shard}: cannot decompress: {e}") from None

        atomic_write(plain, copy)
    return plain


def _copy_zstd(shard: str, out) -> None:
    """Decompress every frame of a zstd file into `out`; a stream that ends inside a frame is an
    error (zstandard's stream reader returns what it has and says nothing: a truncated shard
    would be read short, its lost records never named)."""
    decompressor = zstandard.ZstdDecompressor()
    frame, fed = decompressor.decompressobj(), False
    with open(shard, "rb") as src:
        while chunk := src.read(_CHUNK):
            while chunk:
                out.write(frame.decompress(chunk))
                fed = True
                if frame.eof:  # the next frame, if any, starts in what this one did not use
                    chunk = frame.unused_data
                    frame, fed = decompressor.decompressobj(), False
                else:
                    chunk = b""
    if fed and not frame.eof:
        raise SourceFormatError(f"{shard}: cannot decompress: the zstd stream ends inside a frame (truncated file?)")


def _newlines(chunk: bytes) -> np.ndarray:
    """Positions of the newlines in a chunk. Documents are mostly long lines: then a memchr per
    line (bytes.find) beats comparing every byte in numpy several times over; for short lines
    the numpy scan wins."""
    count = chunk.count(b"\n")
    if count > len(chunk) >> 8:  # lines under 256 bytes on average
        return np.flatnonzero(np.frombuffer(chunk, np.uint8) == 10).astype(np.int64)
    out = np.empty(count, np.int64)
    find, pos = chunk.find, -1
    for i in range(count):
        pos = find(b"\n", pos + 1)
        out[i] = pos
    return out


def _scan_offsets(path: str) -> np.ndarray:
    """Start offset of every line, plus the end of the file (a final line without newline counts)."""
    starts = [np.zeros(1, np.int64)]
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            starts.append(_newlines(chunk) + size + 1)
            size += len(chunk)
    offsets = np.concatenate(starts)
    if offsets[-1] != size:  # last line lacks a newline
        offsets = np.append(offsets, size)
    return offsets


class JsonlShard:
    """Line-addressable view of one JSONL shard."""

    def __init__(self, shard: str, cache_dir: str | None = None) -> None:
        if not os.path.isfile(shard):
            raise SourceFormatError(f"{shard}: file not found")
        self.shard = shard
        self.path = _plain_path(shard, cache_dir)
        self.offsets = self._load_index(_sidecar_path(shard, INDEX_SUFFIX, cache_dir))
        # Lines are read with pread, not through a memory map: a worker touches a few lines of
        # many shards, and mapped pages would count in its resident memory (shared page cache).
        self._fd: int | None = None

    def _load_index(self, index_path: str) -> np.ndarray:
        st = os.stat(self.path)
        stamp = np.array([st.st_size, st.st_mtime_ns], np.int64)
        if os.path.exists(index_path):
            try:
                saved = np.load(index_path, mmap_mode="r")
                if saved.dtype == np.int64 and len(saved) >= 3 and np.array_equal(saved[:2], stamp):
                    return saved[2:]
            except (ValueError, OSError):
                pass  # unreadable index: rebuild it below
        offsets = _scan_offsets(self.path)
        atomic_write(index_path, lambda f: np.save(f, np.concatenate([stamp, offsets])))
        return offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def line(self, i: int) -> bytes:
        """Bytes of line i (0-based), without its newline."""
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        raw = os.pread(self._fd, end - start, start)
        if len(raw) != end - start:
            raise RecordError(f"{self.shard}:{i + 1}: file shorter than its index says (changed while in use?)")
        return raw[:-1] if raw.endswith(b"\n") else raw
