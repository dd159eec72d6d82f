"""Document keys: `source_index << 48 | record_index` in 63 bits (15 bits of source, 48 of
record), so that trainers get them as int64 (torch barely supports uint64: no shifts, no isin).
On the wire they travel as uint64. The one place the packing is written; works on Python ints
and on numpy arrays."""

from __future__ import annotations

from typing import Any

RECORD_BITS = 48
RECORD_MASK = (1 << RECORD_BITS) - 1
MAX_SOURCES = 1 << (63 - RECORD_BITS)  # 32,768


def doc_key(source: Any, record: Any) -> Any:
    """The key of `record` of `source` (ints, or numpy arrays of any integer type -> uint64)."""
    if isinstance(source, int) and isinstance(record, int):
        return (source << RECORD_BITS) | record
    import numpy as np

    return (np.asarray(source, dtype=np.uint64) << np.uint64(RECORD_BITS)) | np.asarray(record).astype(np.uint64,
                                                                                                       copy=False)


def split_doc_key(key: Any) -> tuple[Any, Any]:
    """(source, record) of a key (an int, or a numpy array of keys)."""
    if isinstance(key, int):
        return key >> RECORD_BITS, key & RECORD_MASK
    import numpy as np

    key = np.asarray(key)
    return key >> key.dtype.type(RECORD_BITS), key & key.dtype.type(RECORD_MASK)
