"""Assigning pieces to bins (ranks, micro-batches, sequences) under a token capacity, balancing cost.

Pure functions, no I/O. The baseline algorithm of DESIGN.md: longest-first, each piece to the
least-loaded bin that still has room. A step holds exactly as many tokens as its bins do, so when
no bin has room for a whole piece, the piece is split: its head fills the roomiest bin and its
tail goes back into the queue. Ties break on the lowest index, so the result is deterministic.
"""

from __future__ import annotations

import heapq

import numpy as np
from typing import Callable, NamedTuple, Sequence



class Piece(NamedTuple):
    """A contiguous token range of one record: tokens [offset, offset+length) of the document.
    (A NamedTuple: the planner makes hundreds per step, and these are cheap to build.)"""

    source: int
    position: int  # position in the source's stream (names the prepared instance of the record)
    record: int
    offset: int
    length: int

    @property
    def key(self) -> int:
        return (self.source << 48) | self.record

    def split(self, head_length: int) -> tuple["Piece", "Piece"]:
        head = self._replace(length=head_length)
        tail = self._replace(offset=self.offset + head_length, length=self.length - head_length)
        return head, tail


CostFn = Callable[[int], float]


def assign(pieces: Sequence[Piece], n_bins: int, capacity: int, cost: CostFn) -> tuple[list[list[Piece]], list[float]]:
    """Greedy longest-first assignment with splitting: the pieces of each bin (in assignment
    order) and each bin's cost. Ties go to the lowest bin index."""
    neg_lengths = [-p.length for p in pieces]
    order = sorted(range(len(pieces)), key=neg_lengths.__getitem__)  # stable: ties keep index order
    if n_bins == 1 and -sum(neg_lengths) <= capacity:
        return [[pieces[i] for i in order]], [float(sum(cost(p.length) for p in pieces))]
    pop, push = heapq.heappop, heapq.heappush
    bins: list[list[Piece]] = [[] for _ in range(n_bins)]
    loads = [0.0] * n_bins
    room = [capacity] * n_bins
    by_load = [(0.0, b) for b in range(n_bins)]  # heap of the bins that still have room
    queue = [(neg_lengths[i], i, pieces[i]) for i in order]  # sorted, hence already a heap
    counter = len(pieces)
    while queue:
        _, _, p = pop(queue)
        b = by_load[0][1]
        if room[b] >= p.length:  # the common case: the least-loaded bin has room
            pop(by_load)
        else:
            fitting = [entry for entry in by_load if room[entry[1]] >= p.length]
            if fitting:  # the least-loaded bin that has room
                b = min(fitting)[1]
            else:  # no bin has room for all of it: fill the roomiest bin with its head
                b = max(range(n_bins), key=lambda i: (room[i], -i))
                if room[b] == 0:
                    raise ValueError(f"pieces hold more tokens than {n_bins} bins of {capacity}")
                p, tail = p.split(room[b])
                push(queue, (-tail.length, counter, tail))
                counter += 1
            by_load.remove((loads[b], b))
            heapq.heapify(by_load)
        bins[b].append(p)
        loads[b] += cost(p.length)
        room[b] -= p.length
        if room[b] > 0:
            push(by_load, (loads[b], b))
    return bins, loads


def costs_dealt_in_order(lengths: Sequence[int], n_bins: int, capacity: int, quadratic: float,
                         linear: float) -> list[float]:
    """Per-bin cost of the conventional loader's dealing: the pieces in arrival order, the stream
    cut into consecutive bins of `capacity` tokens (a piece may straddle one cut: no piece is
    longer than a bin)."""
    lens = np.asarray(lengths, dtype=np.float64)
    ends = np.cumsum(lens)
    starts = ends - lens
    first = (starts // capacity).astype(np.int64)
    last = np.minimum((ends - 1) // capacity, n_bins - 1).astype(np.int64)
    head = np.where(last > first, (first + 1) * capacity - starts, lens)
    tail = lens - head
    costs = np.zeros(n_bins)
    np.add.at(costs, np.minimum(first, n_bins - 1), quadratic * head * head + linear * head)
    np.add.at(costs, last, quadratic * tail * tail + linear * tail)
    return costs.tolist()


def imbalance(costs: Sequence[float]) -> float:
    """max/mean of per-rank costs; 1.0 is perfect balance."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0
