"""Records held out of training for evaluation, by a keyed hash of (seed, source, record).

Each source's records are ranked by `record_hash(seed, source, record)`, a uint64 from our own
splitmix64 (library RNGs change between versions). The eval sets that hold out records of a
source take consecutive ranges of that hash in the order the job file lists them: a share p
takes the next p x 2^64 of the range, a count c the next c records (the range ends just past
the c-th smallest hash among the records after the sets before it). A record is held out when
its hash falls in any of them, so whether it is depends on (seed, source, record) and the job's
eval sets only: never on the step, the epoch, a restart, the worker count or the data-parallel
size. The planner passes over held-out records as over skipped ones.
"""

from __future__ import annotations

import numpy as np

from .cursor import _splitmix64_np, splitmix64

HASH_SALT = 0x65766C  # "evl": holdout hashes differ from the stream's keys
CHUNK = 1 << 22  # records hashed at a time when a count needs the order of a whole source
_TOP = np.uint64((1 << 64) - 1)


def record_hash(seed: int, source: int, records: np.ndarray) -> np.ndarray:
    key = np.uint64(splitmix64(splitmix64((seed ^ HASH_SALT) & ((1 << 64) - 1)) ^ source))
    return _splitmix64_np(np.asarray(records, dtype=np.uint64) ^ key)


def _nth_smallest_above(seed: int, source: int, n_records: int, low: int, count: int) -> int:
    """The hash just past the `count`-th smallest hash >= low among a source's records (the end of
    a count's range), found in chunks (a source's hashes are never all held at once)."""
    if count <= 0:
        return low
    best = np.zeros(0, np.uint64)
    for lo in range(0, n_records, CHUNK):
        h = record_hash(seed, source, np.arange(lo, min(n_records, lo + CHUNK), dtype=np.uint64))
        h = h[h >= np.uint64(low)]
        best = np.concatenate([best, h])
        if len(best) > count:
            best = np.partition(best, count - 1)[:count]
    if len(best) < count:  # the count covers every record left
        return 1 << 64
    return int(best.max()) + 1


class Holdout:
    """The hash ranges each eval set holds out of each source, and what falls in them."""

    def __init__(self, seed: int, num_records: list[int], holdouts: list[dict[int, float | int]]) -> None:
        """holdouts: per eval set, in the job file's order, source -> share (float) or count (int)."""
        self.seed = seed
        self.num_records = list(num_records)
        # per set: source -> [low, high) of the hash (high may be 2^64)
        self.ranges: list[dict[int, tuple[int, int]]] = []
        start = [0] * len(num_records)
        for sets in holdouts:
            mine = {}
            for s, amount in sets.items():
                low = start[s]
                if isinstance(amount, float):
                    high = min(1 << 64, low + int(amount * (1 << 64)))
                else:
                    high = _nth_smallest_above(seed, s, num_records[s], low, int(amount))
                mine[s] = (low, high)
                start[s] = high
            self.ranges.append(mine)
        self.end = start  # per source: training keeps the records whose hash is >= end

    def any(self, source: int) -> bool:
        return self.end[source] > 0

    def held_out(self, source: int, records: np.ndarray) -> np.ndarray:
        """Which of these records of a source no training step may hold."""
        end = self.end[source]
        if end == 0:
            return np.zeros(len(records), dtype=bool)
        if end >= 1 << 64:
            return np.ones(len(records), dtype=bool)
        return record_hash(self.seed, source, records) < np.uint64(end)

    def records(self, set_index: int, source: int) -> np.ndarray:
        """The records of a source that eval set `set_index` holds out, in record order."""
        low, high = self.ranges[set_index][source]
        out = []
        for lo in range(0, self.num_records[source], CHUNK):
            recs = np.arange(lo, min(self.num_records[source], lo + CHUNK), dtype=np.uint64)
            h = record_hash(self.seed, source, recs)
            keep = h >= np.uint64(low)
            if high < 1 << 64:
                keep &= h < np.uint64(high)
            out.append(recs[keep].astype(np.int64))
        return np.concatenate(out) if out else np.zeros(0, np.int64)


def sample(seed: int, source: int, records: np.ndarray, n: int) -> np.ndarray:
    """A fixed sample of n of these records (the n smallest hashes under another key), in record order."""
    if n >= len(records):
        return records
    h = record_hash(seed ^ 0x5A5A, source, records)
    return np.sort(records[np.argpartition(h, n - 1)[:n]])
