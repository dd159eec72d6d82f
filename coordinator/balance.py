"""Assigning pieces to bins (ranks, micro-batches, sequences) under a token capacity, balancing cost.

Pure functions, no I/O. The baseline algorithm of DESIGN.md: longest-first, each piece to the
least-loaded bin that still has room. A step holds exactly as many tokens as its bins do, so when
no bin has room for a whole piece, the piece is split: its head fills the roomiest bin and its
tail goes back into the queue. Ties break on the lowest index, so the result is deterministic.
"""

from __future__ import annotations

import heapq
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


def assign(pieces: Sequence[Piece], n_bins: int, capacity: int, cost: CostFn) -> list[list[Piece]]:
    """Greedy longest-first assignment with splitting; returns the pieces of each bin, each in
    assignment order. Ties go to the lowest bin index."""
    neg_lengths = [-p.length for p in pieces]
    order = sorted(range(len(pieces)), key=neg_lengths.__getitem__)  # stable: ties keep index order
    if n_bins == 1 and -sum(neg_lengths) <= capacity:
        return [[pieces[i] for i in order]]
    bins: list[list[Piece]] = [[] for _ in range(n_bins)]
    loads = [0.0] * n_bins
    room = [capacity] * n_bins
    by_load = [(0.0, b) for b in range(n_bins)]  # heap of bins that still have room
    queue = [(-pieces[i].length, i, pieces[i]) for i in order]  # already a valid heap: sorted
    counter = len(pieces)
    while queue:
        _, _, p = heapq.heappop(queue)
        too_small = []
        b = -1
        while by_load:
            load, cand = heapq.heappop(by_load)
            if room[cand] >= p.length:
                b = cand
                break
            too_small.append((load, cand))
        for entry in too_small:
            heapq.heappush(by_load, entry)
        if b < 0:  # no bin has room for all of it: fill the roomiest bin with its head
            b = max(range(n_bins), key=lambda i: (room[i], -i))
            if room[b] == 0:
                raise ValueError(f"pieces hold more tokens than {n_bins} bins of {capacity}")
            by_load.remove((loads[b], b))
            heapq.heapify(by_load)
            p, tail = p.split(room[b])
            heapq.heappush(queue, (-tail.length, counter, tail))
            counter += 1
        bins[b].append(p)
        loads[b] += cost(p.length)
        room[b] -= p.length
        if room[b] > 0:
            heapq.heappush(by_load, (loads[b], b))
    return bins


def deal_in_order(pieces: Sequence[Piece], n_bins: int, capacity: int) -> list[list[Piece]]:
    """The conventional loader's dealing: the stream in arrival order, cut into consecutive bins."""
    bins: list[list[Piece]] = [[] for _ in range(n_bins)]
    b, room = 0, capacity
    for p in pieces:
        while p.length and b < n_bins:
            if p.length <= room:
                bins[b].append(p)
                room -= p.length
                break
            if room:
                head, p = p.split(room)
                bins[b].append(head)
            b, room = b + 1, capacity
        if room == 0:
            b, room = b + 1, capacity
    return bins


def bin_cost(pieces: Sequence[Piece], cost: CostFn) -> float:
    return float(sum(cost(p.length) for p in pieces))


def imbalance(costs: Sequence[float]) -> float:
    """max/mean of per-rank costs; 1.0 is perfect balance."""
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0
