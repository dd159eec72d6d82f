"""Keyed permutation streams: the shuffled order of each source with O(1) memory.

Position p of a source's stream is record `permute(p mod N, key(seed, source, epoch))` with
epoch = p // N. The permutation is a Feistel network on the smallest even-bit domain >= N with
cycle walking, so it is a bijection on [0, N) for any N. Our own hash (splitmix64) drives it,
because library RNG algorithms change between versions and the order must not.
"""

from __future__ import annotations

import numpy as np

try:  # the same permutation, compiled (setup.py); _feistel_np and the cycle-walking loop stand in without it
    from . import _feistel as _compiled
except ImportError:  # pragma: no cover - a build without a C compiler
    _compiled = None
COMPILED = _compiled is not None

_MASK64 = (1 << 64) - 1
_ROUNDS = 6
CHUNK = 8192


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """splitmix64 on a uint64 array (wrapping arithmetic), identical to the scalar version."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def epoch_key(seed: int, source_index: int, epoch: int) -> int:
    return splitmix64(splitmix64(splitmix64(seed & _MASK64) ^ source_index) ^ epoch)


class Permutation:
    """A keyed bijection on [0, n)."""

    def __init__(self, n: int, key: int) -> None:
        if n <= 0:
            raise ValueError("permutation of an empty range")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.half_mask = (1 << self.half) - 1
        self.round_keys = [splitmix64(key ^ (r * 0x632BE59BD9B4E019)) for r in range(_ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.half_mask
        for k in self.round_keys:
            left, right = right, left ^ (splitmix64(right ^ k) & self.half_mask)
        return (left << self.half) | right

    def _feistel_np(self, x: np.ndarray) -> np.ndarray:
        half, mask = np.uint64(self.half), np.uint64(self.half_mask)
        left, right = x >> half, x & mask
        for k in self.round_keys:
            left, right = right, left ^ (_splitmix64_np(right ^ np.uint64(k)) & mask)
        return (left << half) | right

    def many(self, indices: np.ndarray) -> np.ndarray:
        """The permutation of many indices at once (the planner's hot path; same values as __call__)."""
        if COMPILED:
            x = np.array(indices, dtype=np.uint64)  # a copy: permuted in place
            if len(x) and int(x.max()) >= self.n:
                raise IndexError(int(x.max()))
            _compiled.permute(x, self.n, self.half, self.round_keys)
            return x.astype(np.int64)
        return self._many_np(indices)

    def _many_np(self, indices: np.ndarray) -> np.ndarray:
        """many() in numpy: the reference for the compiled version, and its fallback."""
        x = self._feistel_np(np.asarray(indices, dtype=np.uint64))
        n = np.uint64(self.n)
        while True:
            out = x >= n
            if not out.any():
                return x.astype(np.int64)
            x[out] = self._feistel_np(x[out])

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = self._feistel(i)
        while x >= self.n:  # cycle walking: the domain is < 4n, so few iterations expected
            x = self._feistel(x)
        return x


class SourceStream:
    """The shuffled, endlessly repeating record stream of one source (each epoch a new permutation)."""

    def __init__(self, seed: int, source_index: int, num_records: int) -> None:
        self.seed = seed
        self.source_index = source_index
        self.num_records = num_records
        self._perm: Permutation | None = None
        self._perm_epoch = -1
        self._chunk_start = -1  # positions [start, start + len(chunk)) computed in one bulk call
        self._chunk = np.zeros(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> Permutation:
        if epoch != self._perm_epoch:
            self._perm = Permutation(self.num_records, epoch_key(self.seed, self.source_index, epoch))
            self._perm_epoch = epoch
        return self._perm

    def record_at(self, position: int) -> int:
        epoch, i = divmod(position, self.num_records)
        return self._permutation(epoch)(i)

    def records_array(self, start: int, count: int) -> np.ndarray:
        """Records at positions [start, start+count) as an int64 array. Computed in bulk, CHUNK
        positions at a time (numpy's per-call overhead dominates small calls; callers ask for a
        few dozen positions at a time), with one chunk kept: memory stays O(1)."""
        out = np.empty(count, dtype=np.int64)
        pos, end = start, start + count
        while pos < end:
            if not self._chunk_start <= pos < self._chunk_start + len(self._chunk):
                epoch, i = divmod(pos, self.num_records)
                n = min(CHUNK, self.num_records - i)  # a chunk never crosses an epoch boundary
                self._chunk = self._permutation(epoch).many(np.arange(i, i + n, dtype=np.uint64))
                self._chunk_start = pos
            i = pos - self._chunk_start
            n = min(end - pos, len(self._chunk) - i)
            out[pos - start: pos - start + n] = self._chunk[i: i + n]
            pos += n
        return out
