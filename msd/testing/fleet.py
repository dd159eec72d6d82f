"""Many large Megatron sources at the disk cost of one: a real index of R documents (lognormal
lengths, mean ~1,000 tokens) with a sparse .bin of the right size, hard-linked S times. For
tools/bench_scale.py and the start-up tests (306 sources of 10^7 records cost one 191 MB index)."""

from __future__ import annotations

import os

import numpy as np

from msd_common.formats.megatron import _HEADER, CODE_OF_DTYPE, MAGIC, VERSION


def write_index(prefix: str, records: int, seed: int = 0) -> None:
    """A Megatron pair of `records` documents: a real index, a sparse .bin of the right size."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(6.5, 0.9, records), 16, 60_000).astype("<i4")
    pointers = np.zeros(records, dtype="<i8")
    pointers[1:] = np.cumsum(lengths[:-1], dtype=np.int64) * 2
    with open(prefix + ".idx", "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[np.dtype(np.uint16)], records, records + 1))
        f.write(lengths.tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(records + 1, dtype="<i8").tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum(dtype=np.int64)) * 2)


def sources(root: str, count: int, records: int) -> list[str]:
    """Prefixes of `count` sources of `records` documents each under `root`: hard links to one
    template pair, made once."""
    template = os.path.join(root, f"template-{records}", "doc")
    if not os.path.exists(template + ".idx"):
        os.makedirs(os.path.dirname(template), exist_ok=True)
        write_index(template, records)
    out = []
    for s in range(count):
        prefix = os.path.join(root, f"s{records}", f"src{s:03d}")
        if not os.path.exists(prefix + ".idx"):
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            for ext in (".idx", ".bin"):
                os.link(template + ext, prefix + ext)
        out.append(prefix)
    return out
