"""Reused buffers for the micro-batches a client builds.

A micro-batch's arrays (int64 tokens, labels and position ids, float32 loss mask: 28 bytes a
token) are views of one buffer. The trainer takes a micro-batch, computes, drops it and takes
the next, so the same few buffers can serve the whole run instead of one allocation (and, on a
cold heap, page faults) per micro-batch. A buffer is handed out again only when nothing else
refers to it: every numpy view and every tensor made from one (`torch.from_numpy`, and whatever is
derived from that tensor) keeps the buffer's reference count raised, so a trainer that keeps a
micro-batch, or part of one, keeps its buffer out of the pool; data it still holds is never
overwritten. Pinned buffers are not pooled here: torch's caching host allocator reuses pinned
blocks and knows when an asynchronous copy from one has finished, which a reference count
cannot tell.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

POOL_SIZE = 4  # buffers kept per client: the one the trainer holds, the next one built, and spares
AHEAD_POOL = 2  # a micro-batch built ahead allocates no buffer beyond this many (see NoSpareBuffer)


class NoSpareBuffer(Exception):
    """No free buffer for a micro-batch built ahead: the trainer still holds the ones there are.
    Building ahead waits for one instead of allocating a third, which the trainer's previous
    micro-batch, dropped a moment later, would leave spare for good (0.9 MB a rank at 32k rows)."""


class BufferPool:
    def __init__(self, size: int = POOL_SIZE) -> None:
        self._bufs: list[np.ndarray] = []
        self._size = size
        self._lock = threading.Lock()  # the trainer's thread and the client's builder both take buffers
        self._bufs.append(np.empty(0, np.uint8))
        self._free_refs = self._refs(0)  # a buffer that only this pool holds (the count differs by Python version)
        self._bufs.clear()
        self.allocated = 0  # buffers allocated so far (tests and the latency benchmark read it)

    def _refs(self, i: int) -> int:
        return sys.getrefcount(self._bufs[i])

    def take(self, nbytes: int, ahead: bool = False) -> np.ndarray:
        """A uint8 buffer of exactly `nbytes` that nothing outside the pool refers to: a free one
        of that size, or a new one (kept for reuse while the pool has room). ahead: for a
        micro-batch built ahead, which raises NoSpareBuffer rather than grow the pool past
        AHEAD_POOL buffers of that size."""
        with self._lock:
            for i in range(len(self._bufs)):
                if self._bufs[i].nbytes == nbytes and self._refs(i) == self._free_refs:
                    return self._bufs[i]
            if ahead and sum(b.nbytes == nbytes for b in self._bufs) >= AHEAD_POOL:
                raise NoSpareBuffer
            buf = np.empty(nbytes, np.uint8)
            self.allocated += 1
            if len(self._bufs) >= self._size:  # e.g. the row length changed: drop a free buffer of another size
                free = [i for i in range(len(self._bufs)) if self._refs(i) == self._free_refs]
                if not free:
                    return buf  # the trainer holds them all: this one is not kept
                del self._bufs[free[0]]
            self._bufs.append(buf)
            return buf
