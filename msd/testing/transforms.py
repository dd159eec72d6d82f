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
