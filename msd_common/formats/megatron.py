"""Megatron `.bin/.idx` indexed datasets: a memory-mapped reader and a writer, byte-compatible with
megatron-core's `IndexedDatasetBuilder` / `IndexedDataset` (format version 1), without importing it.

.idx layout (little-endian): magic b"MMIDIDX\\x00\\x00", u64 version = 1, u8 dtype code,
u64 sequence_count, u64 document_count, i32 sequence_lengths[sequence_count],
i64 sequence_pointers[sequence_count] (byte offsets into .bin),
i64 document_indices[document_count] (starts at 0; document d spans sequences
[document_indices[d], document_indices[d+1])), then, for multimodal datasets only,
i8 sequence_modes[sequence_count].

One record of ours is one document of the .idx; its tokens are its sequences concatenated.

A prefix may be a URL (storage.py): the .idx is copied into the cache dir once and mapped (the
coordinator plans from it); the tokens are read from the .bin by byte range, the pieces of one
delivery fetched together, nearby ones in one request; or, with `storage.whole_objects`, the .bin
is copied whole into the bounded local cache by the first worker of a host that reads it.
"""

from __future__ import annotations

import logging
import mmap
import os
import resource
import struct
import time
from typing import Any, Callable, Iterable

import numpy as np

from msd_common.files import atomic_write

from .copies import CopyCache
from .errors import SourceFormatError
from .storage import is_url, local_name, store_for

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
log = logging.getLogger("msd.megatron")
_HEADER = struct.Struct("<9sQBQQ")
# Indexes up to this many entries (20 MB of index) are checked in full when opened. Every
# process that reads a source opens its index (the coordinator and each worker process): with
# 306 sources of 10^7 records, a full check touched 61 GB of index pages per process, and
# workers busy opening sources missed their heartbeats.
FULL_CHECK_RECORDS = 1 << 20


def _sample(n: int, count: int = 256) -> np.ndarray:
    """Evenly spread entries of an index of n, both ends included (for a start-up check): a few
    hundred, so that the check reads a few hundred pages, not the whole index."""
    return np.unique(np.linspace(0, n - 1, count).astype(np.int64))


class MegatronIndex:
    """One `prefix.bin` + `prefix.idx` pair, memory-mapped. Checks the index against the data file
    at open, so a truncated or foreign pair is refused here, naming the file."""

    def __init__(self, prefix: str, storage: dict[str, Any] | None = None, cache_dir: str | None = None,
                 cache_bytes: int | None = None) -> None:
        self.prefix = prefix
        idx_path, bin_path = prefix + ".idx", prefix + ".bin"
        self._store = store_for(prefix, storage) if is_url(prefix) else None
        self._prefetched: dict[int, np.ndarray] = {}
        # storage.whole_objects: the .bin is copied whole into the local cache when a document is
        # first read (never by the coordinator, which reads only the .idx), then read locally
        self._whole_copy: CopyCache | None = None
        if self._store is not None:
            idx_local, bin_size = self._fetch_index(cache_dir)
            if self._store.whole_objects:
                self._whole_copy = CopyCache(cache_dir or _default_cache_dir(), cache_bytes)
        else:
            for p in (idx_path, bin_path):
                if not os.path.isfile(p):
                    raise SourceFormatError(f"{p}: file not found")
            idx_local, bin_size = idx_path, os.path.getsize(bin_path)
        idx_size = os.path.getsize(idx_local)
        if idx_size < _HEADER.size:
            raise SourceFormatError(f"{idx_path}: truncated index ({idx_size} bytes, header needs {_HEADER.size})")
        idx = _map(idx_local)
        magic, version, code, n_seq, n_doc = _HEADER.unpack(bytes(idx[: _HEADER.size]))
        if magic != MAGIC:
            raise SourceFormatError(f"{idx_path}: not a Megatron index (magic {magic!r})")
        if version != VERSION:
            raise SourceFormatError(f"{idx_path}: unsupported index version {version}")
        if code not in DTYPE_CODES:
            raise SourceFormatError(f"{idx_path}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        body = _HEADER.size + n_seq * 4 + n_seq * 8 + n_doc * 8
        if idx_size not in (body, body + n_seq):  # + n_seq: optional multimodal sequence_modes
            raise SourceFormatError(
                f"{idx_path}: size {idx_size} does not match {n_seq} sequences and {n_doc} document indices"
            )
        if n_doc < 1:
            raise SourceFormatError(f"{idx_path}: empty document index")
        off = _HEADER.size
        self.sequence_lengths = np.frombuffer(idx, dtype="<i4", count=n_seq, offset=off)
        off += n_seq * 4
        self.sequence_pointers = np.frombuffer(idx, dtype="<i8", count=n_seq, offset=off)
        off += n_seq * 8
        self.document_indices = np.frombuffer(idx, dtype="<i8", count=n_doc, offset=off)
        di = self.document_indices
        # Start-up reads the whole index only while that is cheap; a larger one (a billion records
        # is 20 GB of index) is checked at its ends and on 256 evenly spread entries, and every
        # length read later is checked where it is used (lengths_of).
        sample = _sample(n_doc) if n_doc > FULL_CHECK_RECORDS else slice(None)
        checked = di[sample]
        if di[0] != 0 or di[-1] != n_seq or (len(checked) > 1 and np.any(checked[1:] < checked[:-1])):
            raise SourceFormatError(f"{idx_path}: document indices are not a monotone cover of the sequences")
        if n_seq:
            last_end = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize
            lengths = self.sequence_lengths[_sample(n_seq) if n_seq > FULL_CHECK_RECORDS else slice(None)]
            if last_end > bin_size or np.any(lengths < 0):
                raise SourceFormatError(
                    f"{bin_path}: truncated or foreign data file ({bin_size} bytes, index needs {last_end})"
                )
        # From here on, lookups land on random entries: without this, each page fault on a cold
        # index read ahead (128 KB) around it, and a cold first step of hundreds of sources read
        # mostly pages nobody asked for (after the start-up check, which may scan it in order).
        if hasattr(mmap, "MADV_RANDOM"):
            idx.madvise(mmap.MADV_RANDOM)
        self._bin = _map_random(bin_path) if bin_size and self._store is None else b""
        self._all_tokens = np.frombuffer(self._bin, dtype=self.dtype, count=len(self._bin) // self.dtype.itemsize)
        # .item() gives Python ints without numpy scalar overhead; no .tolist() copies, so memory
        # stays that of the mapped index, whatever the dataset size
        self._first_seq = self.document_indices.item
        self._pointers = self.sequence_pointers.item
        self._lengths = self.sequence_lengths.item

    def _fetch_index(self, cache_dir: str | None) -> tuple[str, int]:
        """(local copy of the remote .idx, size of the remote .bin)."""
        idx_url, bin_url = self.prefix + ".idx", self.prefix + ".bin"
        try:
            _, tag = self._store.stamp(idx_url)
            bin_size, self._bin_tag = self._store.stamp(bin_url)
        except FileNotFoundError as e:
            raise SourceFormatError(f"{e}: object not found") from None
        except OSError as e:
            raise SourceFormatError(f"{self.prefix}: cannot read ({e})") from None
        path = os.path.join(cache_dir or _default_cache_dir(), local_name(idx_url, "", tag))
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            atomic_write(path, lambda out: self._store.download(idx_url, out))
        return path, bin_size

    def prefetch(self, docs: list[int]) -> None:
        """Fetch these documents of a remote .bin together (a prepare task's), nearby ones in one
        request; a document that fails here is fetched again, alone, when read."""
        self._prefetched: dict[int, np.ndarray] = {}
        if self._whole_copy is not None:
            self._read_whole()
        if self._store is None or not docs:
            return
        first = self.document_indices[np.asarray(docs, np.int64)]
        last = self.document_indices[np.asarray(docs, np.int64) + 1]
        single = [d for d, a, b in zip(docs, first.tolist(), last.tolist()) if b == a + 1]
        seqs = self.document_indices[np.asarray(single, np.int64)] if single else np.zeros(0, np.int64)
        starts = self.sequence_pointers[seqs]
        ends = starts + self.sequence_lengths[seqs].astype(np.int64) * self.dtype.itemsize
        try:
            self._prefetched = dict(zip(single, self._read_bin(starts.tolist(), ends.tolist())))
        except OSError as e:
            log.warning("%s.bin: prefetch of %d documents failed (%s); reading them one by one", self.prefix,
                        len(single), e)

    def _read_whole(self) -> None:
        """Copy the remote .bin into the cache (once per host) and read it from there on. A copy
        evicted while mapped stays readable; its disk space is freed when this reader closes."""
        bin_url = self.prefix + ".bin"
        path = self._whole_copy.path(local_name(bin_url, "", self._bin_tag),
                                     lambda out: self._store.download(bin_url, out))
        if os.path.getsize(path):
            self._bin = _map_random(path)
            self._all_tokens = np.frombuffer(self._bin, dtype=self.dtype, count=len(self._bin) // self.dtype.itemsize)
        self._store = self._whole_copy = None

    def _read_bin(self, starts: list[int], ends: list[int]) -> list[np.ndarray]:
        """Tokens of byte ranges of a remote .bin (one coalesced, concurrent fetch)."""
        blobs = self._store.fetch(self.prefix + ".bin", starts, ends)
        return [np.frombuffer(b, dtype=self.dtype) for b in blobs]

    def __len__(self) -> int:
        return len(self.document_indices) - 1

    def document_lengths(self) -> np.ndarray:
        """Tokens per document (int64), computed from the index alone."""
        cums = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return cums[self.document_indices[1:]] - cums[self.document_indices[:-1]]

    def lengths_of(self, docs: np.ndarray) -> np.ndarray:
        """Tokens of each of `docs`, vectorised over the index (no O(dataset) temporary arrays)."""
        first = self.document_indices[docs]
        last = self.document_indices[docs + 1]
        out = self.sequence_lengths[first].astype(np.int64)
        for i in np.flatnonzero(last - first != 1).tolist():  # multi-sequence (or empty) documents
            out[i] = int(self.sequence_lengths[first[i]: last[i]].sum())
        if out.size and out.min() < 0:  # a large index is checked only on a sample when opened
            bad = int(docs[np.argmin(out)])
            raise SourceFormatError(f"{self.prefix}.idx: document {bad} has a negative length: a corrupt index")
        return out

    def pieces(self, docs: np.ndarray, offsets: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """Tokens [offset, offset+length) of each document, as views into the map: positions
        computed for all pieces at once, then one slice per piece (concatenating the slices runs
        at memcpy speed; a fancy-index gather was measured several times slower). Documents of
        several sequences are read one by one, since nothing promises their sequences are
        adjacent in the .bin."""
        docs = np.asarray(docs, dtype=np.int64)
        offsets = np.asarray(offsets, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        first = self.document_indices[docs]
        single = self.document_indices[docs + 1] - first == 1
        in_range = offsets + lengths <= self.sequence_lengths[first]
        if not (single & in_range).all():
            return [self.document(int(d))[o: o + n] for d, o, n in zip(docs, offsets, lengths)]
        if self._whole_copy is not None:
            self._read_whole()
        if self._store is not None:
            byte_starts = self.sequence_pointers[first] + offsets * self.dtype.itemsize
            return self._read_bin(byte_starts.tolist(), (byte_starts + lengths * self.dtype.itemsize).tolist())
        byte_starts = self.sequence_pointers[first] + offsets * self.dtype.itemsize
        if DISK_READS.lately():
            _will_need(self._bin, byte_starts, byte_starts + lengths * self.dtype.itemsize)
        starts = (byte_starts // self.dtype.itemsize).tolist()
        tokens = self._all_tokens
        return [tokens[a: a + n] for a, n in zip(starts, lengths.tolist())]

    def document(self, d: int) -> np.ndarray:
        """The tokens of document d as a read-only array (a view into the mmap when it is one sequence)."""
        first, last = self._first_seq(d), self._first_seq(d + 1)
        if self._whole_copy is not None:
            self._read_whole()
        if self._store is not None:
            fetched = self._prefetched.pop(d, None)
            if fetched is not None:
                return fetched
            seqs = range(first, last)
            parts = self._read_bin([self._pointers(q) for q in seqs],
                                   [self._pointers(q) + self._lengths(q) * self.dtype.itemsize for q in seqs])
            return parts[0] if len(parts) == 1 else np.concatenate(parts) if parts else np.zeros(0, self.dtype)
        if last == first + 1:
            return np.frombuffer(self._bin, dtype=self.dtype, count=self._lengths(first), offset=self._pointers(first))
        parts = [self._sequence(s) for s in range(first, last)]
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.zeros(0, self.dtype)

    def _sequence(self, s: int) -> np.ndarray:
        return np.frombuffer(self._bin, dtype=self.dtype, count=self._lengths(s), offset=self._pointers(s))


def _map(path: str) -> mmap.mmap:
    """Read-only map of a whole file (a plain mmap: np.memmap's subclass overhead shows per record)."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _map_random(path: str) -> mmap.mmap:
    """A .bin mapped for reads of random documents: without MADV_RANDOM each page fault on a cold
    page read ahead 128 KB around it (measured: 4,200 random documents of a 2 GB .bin copied in
    2.0 s from a cold page cache, 0.30 s with it; 0.08 s with _will_need as well)."""
    mm = _map(path)
    if hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM)
    return mm


class DiskReads:
    """Whether this process has lately had to read pages from disk (major page faults), so that
    announcing a delivery's pages to the kernel (_will_need) can help. Where the corpus sits in the
    page cache the announcement only costs: 18 madvise calls per delivery, a tenth of a worker's
    CPU at no compute (tools/bench_wait.py). Announced until the first count (CHECK_EVERY_S), then
    for KEEP_S after a count of at least FAULTS major faults (a single one can be the process's own
    code paged in; a cold corpus faults at every delivery). On a VM that takes page cache back
    (this project's test machines) the corpus of tools/bench_wait.py faults, and is announced."""

    CHECK_EVERY_S = 1.0
    KEEP_S = 60.0
    FAULTS = 2

    def __init__(self, faults: Callable[[], int] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._faults = faults or (lambda: resource.getrusage(resource.RUSAGE_SELF).ru_majflt)
        self._clock = clock
        self.restart()

    def restart(self) -> None:
        """Count from now, announcing until the first count (a new process: its counts start at 0)."""
        now = self._clock()
        self._seen, self._checked, self._until = self._faults(), now, now + self.CHECK_EVERY_S

    def lately(self) -> bool:
        now = self._clock()
        if now - self._checked >= self.CHECK_EVERY_S:
            self._checked = now
            seen = self._faults()
            if seen - self._seen >= self.FAULTS:
                self._until = now + self.KEEP_S
            self._seen = seen
        return now < self._until


DISK_READS = DiskReads()  # one per process
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=DISK_READS.restart)  # a forked worker's faults are its own


def _will_need(mm: mmap.mmap | bytes, starts: np.ndarray, ends: np.ndarray) -> None:
    """Tell the kernel that these byte ranges of a map are about to be read, so that the pages not
    in memory are read together: the copy that follows would fault them in one at a time, each a
    wait on the disk (a corpus larger than memory is read from disk at every step). Adjacent
    ranges (a run of neighbouring documents) are one call; a range in memory costs ~2 us."""
    if not len(starts) or not isinstance(mm, mmap.mmap) or not hasattr(mmap, "MADV_WILLNEED"):
        return
    # Plain Python: a call holds a few pieces, where numpy's per-call cost was most of a delivery's.
    page = mmap.PAGESIZE
    ranges = sorted(zip(starts.tolist(), ends.tolist()))
    lo, hi = ranges[0]
    lo -= lo % page
    for a, b in ranges[1:]:
        a -= a % page
        if a > hi:
            if hi > lo:
                mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)
            lo, hi = a, b
        elif b > hi:
            hi = b
    if hi > lo:
        mm.madvise(mmap.MADV_WILLNEED, lo, hi - lo)


def write_megatron(prefix: str, documents: Iterable[np.ndarray], dtype: np.dtype | type = np.uint16) -> int:
    """Write documents (one sequence each) as `prefix.bin` / `prefix.idx`, exactly as megatron-core's
    IndexedDatasetBuilder.add_document + finalize would. Returns the number of documents."""
    dt = np.dtype(dtype)
    lengths: list[int] = []
    with open(prefix + ".bin", "wb") as f:
        for doc in documents:
            arr = np.ascontiguousarray(doc, dtype=dt)
            f.write(arr.tobytes(order="C"))
            lengths.append(len(arr))
    seq_lengths = np.array(lengths, dtype="<i4")
    pointers = np.zeros(len(lengths), dtype="<i8")
    if lengths:
        pointers[1:] = np.cumsum(seq_lengths[:-1], dtype=np.int64) * dt.itemsize
    doc_indices = np.arange(len(lengths) + 1, dtype="<i8")
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[dt], len(lengths), len(doc_indices)))
        f.write(seq_lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(doc_indices.tobytes())
    return len(lengths)


def _default_cache_dir() -> str:
    from .jsonl import default_cache_dir  # jsonl imports nothing of ours that imports this module

    return default_cache_dir()
