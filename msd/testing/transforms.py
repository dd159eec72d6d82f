"""Transforms for tests and benchmarks (importable by every worker process of this package)."""

from __future__ import annotations

import time

import numpy as np

from worker.transforms import Sample


def busy(record, ctx, ms: float = 2.0):
    """The record's tokens after `ms` of CPU work per record: a deliberately slow transform (as
    real per-sample Python is), for tools/bench_autoscale.py --case slow-transform."""
    until = time.perf_counter() + ms / 1000
    x = 0
    while time.perf_counter() < until:
        x += 1
    return Sample(np.asarray(record["tokens"]))


def slow_every(record, ctx, every: int = 8):
    """The record's text, byte-tokenized; every `every`-th record first sleeps
    $MSD_TEST_SLOW_TRANSFORM_S seconds (0 when unset) in one piece, as a video decode or a model
    called by a transform would (tests/integration/test_never_stall.py). The sleep is set by the
    environment so that the same code, hence the same plan digest, runs fast and slow."""
    import os

    if ctx.record % every == 0:
        time.sleep(float(os.environ.get("MSD_TEST_SLOW_TRANSFORM_S", "0")))
    return Sample(ctx.tokenizer.encode(record["text"]))
