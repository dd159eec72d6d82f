"""What opening a Megatron index checks, small and large: a small index in full; a large one
(over FULL_CHECK_RECORDS entries) on a sample, so that hundreds of sources of 10^7 records open
in milliseconds in every process, and each length where it is read."""

import os

import numpy as np
import pytest

from msd_common.formats.errors import SourceFormatError
from msd_common.formats.megatron import _HEADER, CODE_OF_DTYPE, FULL_CHECK_RECORDS, MAGIC, VERSION, MegatronIndex


def _write(prefix: str, lengths: np.ndarray) -> None:
    n = len(lengths)
    pointers = np.zeros(n, dtype="<i8")
    pointers[1:] = np.cumsum(np.maximum(lengths[:-1], 0), dtype=np.int64) * 2
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(np.uint16)], n, n + 1))
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(np.maximum(lengths, 0).sum(dtype=np.int64)) * 2)


def test_a_small_index_with_a_negative_length_is_refused_at_open(tmp_path):
    lengths = np.full(1000, 7, dtype=np.int64)
    lengths[500] = -3
    _write(str(tmp_path / "small"), lengths)
    with pytest.raises(SourceFormatError, match="small.bin"):
        MegatronIndex(str(tmp_path / "small"))


def test_a_large_index_opens_on_a_sample_and_a_bad_length_is_named_where_it_is_read(tmp_path):
    n = FULL_CHECK_RECORDS + 12345
    lengths = np.full(n, 9, dtype=np.int64)
    bad = n // 2 + 1  # between the sampled entries
    lengths[bad] = -5
    prefix = str(tmp_path / "large")
    _write(prefix, lengths)
    index = MegatronIndex(prefix)  # the sample misses the bad entry: opening does not read it all
    assert len(index) == n
    assert index.lengths_of(np.array([0, 7, n - 1])).tolist() == [9, 9, 9]
    with pytest.raises(SourceFormatError,
                       match=f"{os.path.basename(prefix)}.idx: document {bad} has a negative length"):
        index.lengths_of(np.array([3, bad]))


def test_the_pages_of_a_delivery_are_announced_to_the_kernel_in_merged_page_aligned_runs(tmp_path):
    """_will_need: one madvise(WILLNEED) per run of touching ranges, from the page its first byte
    lies in, so that a cold delivery's pages are read together; pieces() asks it for exactly the
    byte ranges it returns, and the tokens are those of the documents."""
    import mmap

    from msd_common.formats import megatron

    class Recording(mmap.mmap):
        calls: list = []

        def madvise(self, option, start=0, length=None):
            if option == mmap.MADV_WILLNEED:
                Recording.calls.append((start, start + length))
            return super().madvise(option, start, length if length is not None else len(self) - start)

    path = tmp_path / "blob"
    path.write_bytes(bytes(200_000))
    page = mmap.PAGESIZE
    with open(path, "rb") as f:
        mm = Recording(f.fileno(), 0, access=mmap.ACCESS_READ)
    megatron._will_need(mm, np.array([5000, 0, 8192 + 3, 100_003]), np.array([6000, 10, 8200 + 3, 100_013]))
    runs = sorted((a // page * page, b) for a, b in ((5000, 6000), (0, 10), (8195, 8203), (100_003, 100_013)))
    merged = []  # (on 4 KiB pages: (0, 10), (4096, 6000), (8192, 8203), (98304, 100013))
    for a, b in runs:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    assert Recording.calls == merged and len(merged) >= 3
    Recording.calls.clear()
    megatron._will_need(mm, np.array([0, 100, 4000]), np.array([200, 4100, 4200]))  # one run
    assert Recording.calls == [(0, 4200)]

    prefix = str(tmp_path / "docs")
    docs = [np.arange(n, dtype=np.uint16) + i for i, n in enumerate([3000, 10, 7000, 1])]
    megatron.write_megatron(prefix, docs, np.uint16)
    index = megatron.MegatronIndex(prefix)
    asked = []
    index._bin = type("Spy", (), {})()  # not a map: _will_need is skipped, the tokens still come from the map
    real = megatron._will_need
    megatron.DISK_READS.restart()  # as in a fresh process: its corpus may be cold
    try:
        megatron._will_need = lambda mm, starts, ends: asked.append((starts.tolist(), ends.tolist()))
        parts = index.pieces(np.array([2, 0]), np.array([5, 0]), np.array([100, 3000]))
    finally:
        megatron._will_need = real
    assert [p.tolist() for p in parts] == [docs[2][5:105].tolist(), docs[0].tolist()]
    start_2 = (3000 + 10) * 2
    assert asked == [([start_2 + 10, 0], [start_2 + 210, 6000])]


def test_pages_are_announced_while_the_process_reads_from_disk_and_not_once_it_stops():
    """DiskReads: a fresh process announces until its first count of major page faults, then only
    within KEEP_S of a count of FAULTS or more (counted once a CHECK_EVERY_S): a corpus in the
    page cache gains nothing from the madvise calls."""
    from msd_common.formats.megatron import DiskReads

    now, faults = [0.0], [5]
    watch = DiskReads(faults=lambda: faults[0], clock=lambda: now[0])
    assert watch.lately()  # a fresh process, before its first count
    now[0] = DiskReads.CHECK_EVERY_S
    assert not watch.lately()  # no disk reads since
    faults[0] = 5 + DiskReads.FAULTS - 1
    now[0] += DiskReads.CHECK_EVERY_S
    assert not watch.lately()  # a few faults: the process's own code paged in
    faults[0] += DiskReads.FAULTS
    now[0] += 0.5
    assert not watch.lately()  # counted only once a CHECK_EVERY_S
    now[0] += DiskReads.CHECK_EVERY_S
    assert watch.lately()  # faults seen: announced again
    now[0] += DiskReads.KEEP_S - 1
    assert watch.lately()
    now[0] += 2
    assert not watch.lately()
    watch.restart()  # a forked child: its own counts, a fresh window
    assert watch.lately()
