"""`runtime.copies: seekable`: compressed JSONL shards kept in the Zstandard seekable format
instead of decompressed. A real job (coordinator, worker host, trainer ranks) must serve exactly
the stream, and the tokens, that the same job serves from plain copies."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from tests.conftest import build_dataset, job_dict, write_job

from .harness import run_job, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_a_job_on_seekable_copies_serves_the_stream_and_tokens_of_plain_copies(tmp_path):
    streams, copies_written = {}, {}
    for copies in ("plain", "seekable"):
        root = tmp_path / copies
        build_dataset(str(root))
        path = write_job(str(root), job_dict(runtime={**job_dict()["runtime"], "copies": copies}))
        streams[copies] = run_job(path, workers=2, ranks=2, steps=8)
        copies_written[copies] = sorted(os.path.basename(p) for p in glob.glob(str(root / "long" / "*.msd.*"))
                                        if not p.endswith((".synced", ".lock")))
    assert copies_written == {"plain": ["long-0.jsonl.zst.msd.jsonl"],
                              "seekable": ["long-0.jsonl.zst.msd.seekable.zst"]}
    assert signature(streams["seekable"]) == signature(streams["plain"])
    long_pieces = 0
    for rank, batches in streams["plain"].items():
        for a, b in zip(batches, streams["seekable"][rank], strict=True):
            np.testing.assert_array_equal(a["tokens"], b["tokens"])
            long_pieces += int(((a["doc_keys"] >> 48) == 2).sum())  # source 2: the compressed one
    assert long_pieces > 0, "the compressed source was read"
