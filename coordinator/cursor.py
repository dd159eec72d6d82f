"""Keyed permutation streams: the shuffled order of each source with O(1) memory.

Position p of a source's stream is record `permute(p mod N, key(seed, source, epoch))` with
epoch = p // N. The permutation is a Feistel network on the smallest even-bit domain >= N with
cycle walking, so it is a bijection on [0, N) for any N. Our own hash (splitmix64) drives it,
because library RNG algorithms change between versions and the order must not.

A source with `shuffle_block: B` > 1 is shuffled in blocks (`BlockPermutation`): runs of B
consecutive records in a random order of the runs, each run's records in a random order among
themselves. B consecutive stream positions then lie in one run of the shard, which a worker reads
in one request from object storage (a record-level shuffle asks for one range per record).
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
# positions permuted per bulk call, and kept: one chunk per source (8192 held 19 MB at 306
# sources); a larger request is computed whole
CHUNK = 1024


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


class BlockPermutation:
    """A keyed bijection on [0, n) that keeps runs of `block` consecutive values together: index
    i falls in slot i // block of the output, slot j holds the values of block Pb(j) (a
    Permutation of the full blocks), in the order of a Permutation of their own. A last, shorter
    block (n not a multiple of block) takes a slot of its own, drawn from the key."""

    def __init__(self, n: int, key: int, block: int) -> None:
        if n <= 0:
            raise ValueError("permutation of an empty range")
        if block < 2:
            raise ValueError("blocks of fewer than 2 records: use Permutation")
        self.n, self.block, self.key = n, block, key
        self.full = n // block  # blocks of `block` values
        self.tail = n - self.full * block  # values of the last, shorter block (0: none)
        self.blocks = Permutation(self.full, key) if self.full else None
        # the slot of the shorter block, among the full blocks' slots
        self.tail_slot = splitmix64(key ^ 0x5DEECE66D) % (self.full + 1) if self.tail else self.full
        self._inner: dict[int, Permutation] = {}  # a few recent blocks' own orders

    def _within(self, block_no: int) -> Permutation:
        perm = self._inner.get(block_no)
        if perm is None:
            if len(self._inner) > 4096:
                self._inner.clear()
            size = self.tail if block_no == self.full else self.block
            block_key = splitmix64(self.key ^ (((block_no + 1) * 0x9E3779B97F4A7C15) & _MASK64))
            perm = self._inner[block_no] = Permutation(size, block_key)
        return perm

    def _locate(self, i: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block number, position within the block's own order) of each index."""
        tail_start = self.tail_slot * self.block
        after = i >= tail_start + self.tail  # past the shorter block's slot: shifted back by its size
        j = np.where(after, i - self.tail, i)
        in_tail = (i >= tail_start) & ~after if self.tail else np.zeros(len(i), dtype=bool)
        slot, offset = j // self.block, j % self.block
        block_no = np.full(len(i), self.full, dtype=np.int64)
        full = ~in_tail
        if full.any():
            block_no[full] = self.blocks.many(slot[full].astype(np.uint64))
        offset = np.where(in_tail, i - tail_start, offset)
        return block_no, offset

    def many(self, indices: np.ndarray) -> np.ndarray:
        i = np.asarray(indices, dtype=np.int64)
        if len(i) and (int(i.min()) < 0 or int(i.max()) >= self.n):
            raise IndexError(int(i.max()))
        block_no, offset = self._locate(i)
        out = np.empty(len(i), dtype=np.int64)
        order = np.argsort(block_no, kind="stable")  # one call of a block's own order per block
        bounds = np.flatnonzero(np.diff(block_no[order])) + 1
        for group in np.split(order, bounds) if len(order) else ():
            b = int(block_no[group[0]])
            out[group] = b * self.block + self._within(b).many(offset[group].astype(np.uint64))
        return out

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return int(self.many(np.array([i], dtype=np.int64))[0])


class SourceStream:
    """The shuffled, endlessly repeating record stream of one source (each epoch a new permutation;
    with block > 1 a BlockPermutation)."""

    def __init__(self, seed: int, source_index: int, num_records: int, block: int = 1) -> None:
        self.seed = seed
        self.source_index = source_index
        self.num_records = num_records
        self.block = block
        self._perm: Permutation | BlockPermutation | None = None
        self._perm_epoch = -1
        self._chunk_start = -1  # positions [start, start + len(chunk)) computed in one bulk call
        self._chunk = np.zeros(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> Permutation | BlockPermutation:
        if epoch != self._perm_epoch:
            key = epoch_key(self.seed, self.source_index, epoch)
            self._perm = (BlockPermutation(self.num_records, key, self.block) if self.block > 1
                          else Permutation(self.num_records, key))
            self._perm_epoch = epoch
        return self._perm

    def record_at(self, position: int) -> int:
        epoch, i = divmod(position, self.num_records)
        return self._permutation(epoch)(i)

    def records_array(self, start: int, count: int) -> np.ndarray:
        """Records at positions [start, start+count) as an int64 array. Computed in bulk, at
        least CHUNK positions at a time (numpy's per-call overhead dominates small calls; callers
        ask for a few dozen positions at a time), with one chunk of CHUNK kept: memory stays O(1)."""
        out = np.empty(count, dtype=np.int64)
        pos, end = start, start + count
        while pos < end:
            if self._chunk_start <= pos < self._chunk_start + len(self._chunk):
                chunk, at = self._chunk, self._chunk_start
            else:
                epoch, i = divmod(pos, self.num_records)
                n = min(max(CHUNK, end - pos), self.num_records - i)  # a chunk never crosses an epoch boundary
                chunk, at = self._permutation(epoch).many(np.arange(i, i + n, dtype=np.uint64)), pos
                if n <= CHUNK:  # kept for the next small request; a large one is used up here
                    self._chunk, self._chunk_start = chunk, at
            i = pos - at
            n = min(end - pos, len(chunk) - i)
            out[pos - start: pos - start + n] = chunk[i: i + n]
            pos += n
        return out
