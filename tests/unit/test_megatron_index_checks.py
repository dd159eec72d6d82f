"""What opening a Megatron index checks, small and large: a small index in full; a large one
(over FULL_CHECK_RECORDS entries) on a sample, so that hundreds of sources of 10^7 records open
in milliseconds in every process, and each length where it is read."""

import os

import numpy as np
import pytest

from worker.readers.errors import SourceFormatError
from worker.readers.megatron import _HEADER, CODE_OF_DTYPE, FULL_CHECK_RECORDS, MAGIC, VERSION, MegatronIndex


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
    with pytest.raises(SourceFormatError, match=f"{os.path.basename(prefix)}.idx: document {bad} has a negative length"):
        index.lengths_of(np.array([3, bad]))
