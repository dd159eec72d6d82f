"""Laying out one step's pieces on the grid of ranks x micro-batches x sequences, balancing cost.

Pure functions on arrays, no I/O. A step's pieces (document ranges, each at most seq_len tokens)
go into rows (packed sequences) of a fixed capacity; a rank owns `micro_batches x
micro_batch_size` rows. The cost of a row is the sum over its pieces of a*len^2 + b*len
(attention is quadratic per document piece, the rest linear).

Methods (`balance.method`):
- greedy (default): longest piece first, to the cheapest rank that has a row with room for the
  whole piece; within that rank to the cheapest micro-batch, then the cheapest row, that fits.
  When no rank has room for the whole piece, its head fills the roomiest row of the roomiest rank
  and its tail goes back into the queue. Balancing ranks first and micro-batches within a rank
  second is what pipeline parallelism needs: every rank and every micro-batch waits for the slowest.
- karmarkar_karp: the largest differencing method over rank costs, then the same row placement
  within each rank.
- none: the conventional loader, as a baseline: pieces in arrival order fill rows one after another.
Ties break on the lowest index, so every layout is deterministic.
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple, Sequence

import numpy as np

METHODS = ("greedy", "karmarkar_karp", "none")


class Grid(NamedTuple):
    ranks: int
    micro_batches: int  # per rank
    micro_batch_size: int  # rows per micro-batch
    row_capacity: int  # tokens a row may hold (seq_len, or more with token slack)

    @property
    def rows_per_rank(self) -> int:
        return self.micro_batches * self.micro_batch_size


class Cost(NamedTuple):
    """cost(piece) = quadratic*len^2 + linear*len, plus for image-text pieces
    patch_quadratic*patches^2 + patch_linear*patches. A piece's patches are taken as
    patch_ratio[piece] x its length (exact for a whole document; a fragment of a split one is
    charged its share), so every piece has its own quadratic and linear coefficient."""

    quadratic: float
    linear: float
    patch_ratio: "np.ndarray | None" = None  # per piece of the step: patches per token; None: text only
    patch_quadratic: float = 0.0
    patch_linear: float = 0.0

    def coefficients(self, pieces: np.ndarray) -> tuple:
        """(quadratic, linear) of the given pieces: floats for a text-only step, else arrays."""
        if self.patch_ratio is None:
            return self.quadratic, self.linear
        r = self.patch_ratio[pieces]
        return self.quadratic + self.patch_quadratic * r * r, self.linear + self.patch_linear * r

    def of(self, lengths: np.ndarray, pieces: "np.ndarray | None" = None) -> np.ndarray:
        """Cost of fragments of the given lengths, of the given pieces (default: piece i is fragment i)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        q, lin = self.coefficients(np.arange(len(lengths)) if pieces is None else pieces)
        return q * lengths * lengths + lin * lengths


class Layout(NamedTuple):
    """Fragments of the step's pieces, in packing order within each row. A piece that had to be
    split appears as several fragments (offset > 0 for all but its head)."""

    piece: np.ndarray  # index of the drawn piece
    offset: np.ndarray  # first token of the fragment within the piece
    length: np.ndarray
    row: np.ndarray  # rank * rows_per_rank + micro_batch * micro_batch_size + sequence

    def rank_costs(self, grid: Grid, cost: Cost) -> np.ndarray:
        return np.bincount(self.row // grid.rows_per_rank, weights=cost.of(self.length, self.piece),
                           minlength=grid.ranks)


def layout(method: str, lengths: np.ndarray, grid: Grid, cost: Cost) -> Layout:
    if method == "greedy":
        return greedy(lengths, grid, cost)
    if method == "greedy_exact":  # the reference rule, one piece at a time (slow at scale)
        return greedy_exact(lengths, grid, cost)
    if method == "karmarkar_karp":
        return karmarkar_karp(lengths, grid, cost)
    if method == "none":
        return in_order(lengths, grid)
    raise ValueError(f"unknown balance method {method!r} (known: {', '.join(METHODS)})")


_AVAILABLE, _PARKED, _FULL = 0, 1, 2


class _Rows:
    """Rows of every rank with their room and costs, and the rule for picking a row inside a rank."""

    def __init__(self, grid: Grid, cost: Cost) -> None:
        self.grid, self.cost = grid, cost
        self.rpr, self.mbs = grid.rows_per_rank, grid.micro_batch_size
        self.q, self.lin = float(cost.quadratic), float(cost.linear)
        # per-piece coefficients of an image-text step (None: every piece has q and lin)
        self.qs, self.lins = ((None, None) if cost.patch_ratio is None else
                              (list(map(float, a)) for a in cost.coefficients(np.arange(len(cost.patch_ratio)))))
        n_rows = grid.ranks * grid.rows_per_rank
        self.room = [grid.row_capacity] * n_rows
        self.row_cost = [0.0] * n_rows
        self.mb_cost = [0.0] * (grid.ranks * grid.micro_batches)
        self.rank_cost = [0.0] * grid.ranks
        self.rank_room = [grid.row_capacity] * grid.ranks  # the largest room of any of its rows
        self.out: list[tuple[int, int, int, int]] = []  # (piece, offset, length, row)

    def fitting_row(self, rank: int, length: int) -> int:
        """The row of `rank` to take a piece of `length`: cheapest micro-batch, then cheapest row,
        among rows with room for it (-1 if none)."""
        rpr, mbs = self.rpr, self.mbs
        first = rank * rpr
        if rpr == 1:
            return first if self.room[first] >= length else -1
        room, row_cost = self.room, self.row_cost
        if mbs == 1:  # micro-batch == row
            fits = [(row_cost[r], r) for r in range(first, first + rpr) if room[r] >= length]
        else:
            mb_cost = self.mb_cost
            fits = [(mb_cost[r // mbs], row_cost[r], r) for r in range(first, first + rpr) if room[r] >= length]
        return min(fits)[-1] if fits else -1

    def roomiest_row(self, rank: int) -> int:
        rpr = self.grid.rows_per_rank
        first = rank * rpr
        room = self.room
        return max(range(first, first + rpr), key=lambda r: (room[r], -r))

    def place(self, piece: int, offset: int, length: int, row: int) -> int:
        """Put a fragment into a row; returns the row's rank."""
        self.out.append((piece, offset, length, row))
        q, lin = (self.q, self.lin) if self.qs is None else (self.qs[piece], self.lins[piece])
        c = q * length * length + lin * length
        rpr = self.grid.rows_per_rank
        rank = row // rpr
        self.room[row] -= length
        self.row_cost[row] += c
        self.mb_cost[row // self.grid.micro_batch_size] += c
        self.rank_cost[rank] += c
        self.rank_room[rank] = self.room[row] if rpr == 1 else max(self.room[rank * rpr:(rank + 1) * rpr])
        return rank

    def result(self) -> Layout:
        if not self.out:
            empty = np.zeros(0, dtype=np.int64)
            return Layout(empty, empty, empty, empty)
        a = np.array(self.out, dtype=np.int64)
        order = np.argsort(a[:, 3], kind="stable")  # rows in order; pieces in placement order within a row
        a = a[order]
        return Layout(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


CAP_MARGIN = 0.005  # pieces are split for balance only past the lower bound plus this
TAIL_COST_SHARE = 0.02  # the smallest pieces holding this share of a step's cost are water-filled


def greedy(lengths: np.ndarray, grid: Grid, cost: Cost) -> Layout:
    """The default method: the longest-first greedy, with the long tail of small pieces placed in
    one vectorised pass (planning has a budget of milliseconds for thousands of pieces):
    1. head (the large pieces, which hold most of the cost): the exact greedy, one piece at a
       time. When every row must end up full (no token slack), a rank's cost is counted together
       with what filling its remaining room with tail pieces will add (room x the tail's cost per
       token), so the head is balanced for the final layout, not for its own part of it;
    2. tail (the smallest pieces, TAIL_COST_SHARE of the cost): rows get token budgets by water
       filling (cheapest rows first, up to their room; without slack every row's budget is its
       room), then the tail is laid out longest first into the cheapest rows, cut where a row's
       budget ends."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_fits(lengths, grid)
    n = len(lengths)
    order = np.argsort(-_sort_key(lengths, cost), kind="stable")
    costs = cost.of(lengths[order], order)
    tail_cost = np.cumsum(costs[::-1])[::-1]  # cost of pieces i.. (longest-first order)
    head = int(np.searchsorted(-tail_cost, -TAIL_COST_SHARE * tail_cost[0])) if n else 0
    tail_tokens = int(lengths[order[head:]].sum())
    exact_fill = tail_tokens == grid.ranks * grid.rows_per_rank * grid.row_capacity - int(lengths[order[:head]].sum())
    density = float(costs[head:].sum()) / tail_tokens if exact_fill and tail_tokens else 0.0
    # The lower bound on the busiest rank's cost: no rank can do better than the mean, nor than
    # the costliest piece. Pieces that would push a rank past it (plus a little) are split.
    cap = max(float(costs.sum()) / grid.ranks, float(costs[0]) if n else 0.0) * (1 + CAP_MARGIN)
    rows = _Rows(grid, cost)
    if head:
        greedy_exact(lengths, grid, cost, rows, order[:head].tolist(), room_cost=density, cost_cap=cap)
    state = _ArrayRows.from_rows(rows)
    state.water_fill(order[head:], lengths)
    return state.result()


def _sort_key(lengths: np.ndarray, cost: Cost) -> np.ndarray:
    """What "longest first" orders by: the length, or for a step with image-text pieces (whose
    cost is not a function of length alone) the cost."""
    return lengths if cost.patch_ratio is None else cost.of(lengths)


def _check_fits(lengths: np.ndarray, grid: Grid) -> None:
    if int(lengths.sum()) > grid.ranks * grid.rows_per_rank * grid.row_capacity:
        raise ValueError(f"{int(lengths.sum())} tokens do not fit {grid.ranks} ranks x {grid.rows_per_rank} rows "
                         f"of {grid.row_capacity}")


class _ArrayRows:
    """Row state as arrays, for the vectorised phases of the greedy."""

    def __init__(self, grid: Grid, cost: Cost) -> None:
        self.grid, self.cost = grid, cost
        rpr = grid.rows_per_rank
        self.room = np.full((grid.ranks, rpr), grid.row_capacity, dtype=np.int64)
        self.row_cost = np.zeros((grid.ranks, rpr))
        self.mb_cost = np.zeros((grid.ranks, grid.micro_batches))
        self.rank_cost = np.zeros(grid.ranks)
        self.frags: list[np.ndarray] = []  # [piece, offset, length, row] blocks, in placement order

    @classmethod
    def from_rows(cls, rows: "_Rows") -> "_ArrayRows":
        g = rows.grid
        self = cls(g, rows.cost)
        self.room[:] = np.array(rows.room, dtype=np.int64).reshape(g.ranks, -1)
        self.row_cost[:] = np.array(rows.row_cost).reshape(g.ranks, -1)
        self.mb_cost[:] = np.array(rows.mb_cost).reshape(g.ranks, -1)
        self.rank_cost[:] = rows.rank_cost
        if rows.out:
            self.frags.append(np.array(rows.out, dtype=np.int64))
        return self

    def water_fill(self, pieces: np.ndarray, lengths: np.ndarray) -> None:
        """The tail of small pieces. Token budgets per row lift the cheapest rows towards a common
        cost level (as far as their room allows), then the pieces, longest first, fill the rows
        cheapest first, cut where a row's budget ends."""
        if not len(pieces):
            return
        need = lengths[pieces]
        total = int(need.sum())
        room = self.room.ravel()
        row_cost = self.row_cost.ravel()
        if int(room.sum()) == total:
            budget = room.copy()
        else:  # level ranks first, then the rows within each rank
            density = max(float(self.cost.of(need, pieces).sum()) / total, 1e-12)  # cost per tail token
            per_rank = _water_level(self.rank_cost[None, :], self.room.sum(axis=1)[None, :], np.array([total]),
                                    density)[0]
            budget = _water_level(self.row_cost, self.room, per_rank, density).ravel()
        rows = np.lexsort((np.arange(len(room)), row_cost))  # cheapest rows first
        rows = rows[budget[rows] > 0]
        # Deal the pieces (longest first) across the rows before cutting the stream into budgets,
        # so every row gets a sample of all sizes: the cost per token the budgets assume.
        k = len(rows)
        dealt = np.lexsort((np.arange(len(pieces)) // k, np.arange(len(pieces)) % k))
        pieces, need = pieces[dealt], need[dealt]
        ends = np.cumsum(need)
        starts = ends - need
        cuts = np.cumsum(budget[rows])
        bounds = np.union1d(np.concatenate([starts, [total]]), cuts)
        frag_start, frag_end = bounds[:-1], bounds[1:]
        piece_i = np.searchsorted(ends, frag_start, side="right")
        row_i = np.searchsorted(cuts, frag_start, side="right")
        flat = rows[row_i]
        rpr = self.grid.rows_per_rank
        # rows repeat within the call: add costs with np.add.at via a per-row loop-free path
        frag_len = frag_end - frag_start
        c = self.cost.of(frag_len, pieces[piece_i])
        r, col = flat // rpr, flat % rpr
        np.subtract.at(self.room, (r, col), frag_len)
        np.add.at(self.row_cost, (r, col), c)
        np.add.at(self.mb_cost, (r, col // self.grid.micro_batch_size), c)
        np.add.at(self.rank_cost, r, c)
        self.frags.append(np.column_stack([pieces[piece_i], frag_start - starts[piece_i], frag_len, flat]))

    def result(self) -> Layout:
        if not self.frags:
            empty = np.zeros(0, dtype=np.int64)
            return Layout(empty, empty, empty, empty)
        a = np.concatenate(self.frags).astype(np.int64)
        a = a[np.argsort(a[:, 3], kind="stable")]
        return Layout(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def _water_level(cost: np.ndarray, room: np.ndarray, total: np.ndarray, density: float) -> np.ndarray:
    """Integer token budgets per bin, for groups of bins at once: cost and room are [groups, bins],
    total is [groups]. Within each group the budgets lie within the bins' room, sum to the
    group's total, and bring the bins' costs (cost + density x tokens) as close to one common
    level as the rooms allow (water filling: the cheapest bins are filled first)."""
    lo = cost.min(axis=1)
    hi = (cost + density * room).max(axis=1)
    for _ in range(32):  # bisection on each group's level (2^-32 of the initial gap is plenty)
        mid = 0.5 * (lo + hi)
        low = np.clip((mid[:, None] - cost) / density, 0, room).sum(axis=1) < total
        lo, hi = np.where(low, mid, lo), np.where(low, hi, mid)
    share = np.clip((hi[:, None] - cost) / density, 0, room)
    budget = np.minimum(np.floor(share).astype(np.int64), room)
    # hand out what rounding left (or took too much), one token per bin, largest remainders first
    for g in np.flatnonzero(budget.sum(axis=1) != total).tolist():
        b, r, frac = budget[g], room[g], share[g] - budget[g]
        short = int(total[g] - b.sum())
        while short:
            step = 1 if short > 0 else -1
            can = np.flatnonzero(b < r) if step > 0 else np.flatnonzero(b > 0)
            can = can[np.lexsort((can, -frac[can] * step))][:abs(short)]
            b[can] += step
            short -= step * len(can)
    return budget


MIN_SPLIT = 128  # no piece is cut for balance into parts shorter than this


def _head_for(budget: float, q: float, lin: float) -> int:
    """The longest length h with q*h^2 + lin*h <= budget."""
    if budget <= 0:
        return 0
    if q > 0:
        return int((-lin + math.sqrt(lin * lin + 4 * q * budget)) / (2 * q))
    return int(budget / lin) if lin > 0 else 1 << 62


def greedy_exact(lengths: np.ndarray, grid: Grid, cost: Cost, rows: "_Rows | None" = None,
                 pieces: "list[int] | None" = None, room_cost: float = 0.0,
                 cost_cap: float = math.inf) -> Layout:
    """Longest-first greedy over ranks, then micro-batches, then rows, one piece at a time (see the
    module docstring). `rows` and `pieces` continue a partial layout with the given pieces; with
    `room_cost`, ranks are compared by cost + room_cost x their tokens of room left. A piece that
    would take even the cheapest rank past `cost_cap` is split so that its head fills that rank
    to the cap (pieces of a few dominant documents cannot be balanced otherwise).

    Ranks that cannot take the current piece are parked in a heap by room, and come back as soon
    as a piece fits their room (checked before every piece), so each placement costs O(log ranks
    + rows per rank). Pieces go costliest first: by length, or by cost when image patches make
    cost more than a function of length (then a later piece may be longer; parked ranks whose
    room is too small for it simply stay parked)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    keys = _sort_key(lengths, cost)
    if rows is None:
        _check_fits(lengths, grid)
        rows = _Rows(grid, cost)
        order = np.argsort(-keys, kind="stable")
    else:
        pieces = np.asarray(pieces, dtype=np.int64)
        order = pieces[np.lexsort((pieces, -keys[pieces]))]
    # (-sort key, tie, piece, offset, length), sorted: a heap
    queue = [(-k, i, i, 0, n) for i, k, n in zip(order.tolist(), keys[order].tolist(), lengths[order].tolist())]
    # locals: this loop runs once per piece, thousands of times per step at scale
    rank_cost, rank_room, room, row_cost, mb_cost = rows.rank_cost, rows.rank_room, rows.room, rows.row_cost, rows.mb_cost
    out = rows.out
    q, lin = rows.q, rows.lin
    qs, lins = rows.qs, rows.lins
    rpr, mbs = grid.rows_per_rank, grid.micro_batch_size
    state = [_AVAILABLE if rank_room[r] > 0 else _FULL for r in range(grid.ranks)]
    version = [0] * grid.ranks
    # the heap key: the rank's cost, plus what filling its room will add (room_cost per token)
    key = [rank_cost[r] + room_cost * sum(room[r * rpr:(r + 1) * rpr]) for r in range(grid.ranks)]
    available = sorted((key[r], r, 0) for r in range(grid.ranks) if state[r] == _AVAILABLE)  # a heap
    parked: list[tuple[int, int, int]] = []  # (-room, rank, version)
    pop, push, heapreplace = heapq.heappop, heapq.heappush, heapq.heapreplace
    while queue:
        _, tie, piece, offset, length = pop(queue)
        if qs is not None:
            q, lin = qs[piece], lins[piece]
        while parked and -parked[0][0] >= length:  # ranks that have room again for pieces this small
            _, r, v = pop(parked)
            if state[r] == _PARKED and v == version[r]:
                state[r] = _AVAILABLE
                push(available, (key[r], r, v))
        rank = -1
        while available:
            _, r, v = available[0]
            if state[r] != _AVAILABLE or v != version[r]:
                pop(available)  # stale entry
            elif rank_room[r] >= length:
                rank = r
                break
            else:
                pop(available)
                state[r] = _PARKED
                push(parked, (-rank_room[r], r, v))
        from_top = rank >= 0  # the rank is the top entry of `available`
        if from_top:
            take = length
            over = key[rank] + q * length * length + (lin - room_cost) * length - cost_cap
            if over > 0 and length >= 2 * MIN_SPLIT:
                # Even the cheapest rank would pass the cap: its share of the piece is the head
                # that brings it to the cap; the tail goes back into the queue.
                head = _head_for(cost_cap - key[rank], q, lin - room_cost)
                if MIN_SPLIT <= head <= length - MIN_SPLIT:
                    take = head
                    rest = length - take
                    push(queue, (-(rest if qs is None else q * rest * rest + lin * rest), tie, piece, offset + take,
                                 rest))
                    length = take
            if rpr == 1:
                row = rank
            elif mbs == 1:  # micro-batch == row: the cheapest row with room
                row, best = -1, 0.0
                for r in range(rank * rpr, (rank + 1) * rpr):
                    if room[r] >= length and (row < 0 or row_cost[r] < best):
                        row, best = r, row_cost[r]
            else:
                row = rows.fitting_row(rank, length)
        else:  # no rank has room for all of it: its head fills the roomiest row of the roomiest rank
            while parked and (state[parked[0][1]] != _PARKED or parked[0][2] != version[parked[0][1]]):
                pop(parked)
            if not parked:
                raise ValueError("pieces hold more tokens than the rows")  # guarded above; kept for safety
            rank = parked[0][1]
            row = rows.roomiest_row(rank)
            take = room[row]
            rest = length - take
            push(queue, (-(rest if qs is None else q * rest * rest + lin * rest), tie, piece, offset + take, rest))
        # place the fragment (as _Rows.place, inlined)
        out.append((piece, offset, take, row))
        c = q * take * take + lin * take
        room[row] -= take
        row_cost[row] += c
        mb_cost[row // mbs] += c
        rank_cost[rank] += c
        key[rank] += c - room_cost * take
        rank_room[rank] = room[row] if rpr == 1 else max(room[rank * rpr:(rank + 1) * rpr])
        version[rank] += 1
        # the placed rank's entry is its heap's top: replace it in place (one heap operation)
        if rank_room[rank] == 0:
            state[rank] = _FULL
            pop(available if from_top else parked)
        elif from_top:
            heapreplace(available, (key[rank], rank, version[rank]))
        else:
            heapreplace(parked, (-rank_room[rank], rank, version[rank]))
    return rows.result()


def karmarkar_karp(lengths: np.ndarray, grid: Grid, cost: Cost) -> Layout:
    """Largest differencing over rank costs (Karmarkar-Karp for m-way partitioning), subject to
    each rank's token capacity, then the greedy's row placement within each rank.

    Each piece starts as a partial partition with its cost in one of m slots; the two partial
    partitions with the largest spread are merged, heaviest slot with lightest slot, until one
    remains. Token capacity is not part of the differencing, so pieces of ranks over capacity are
    then moved (cheapest cost increase first; split if needed) to ranks with room."""
    lengths = np.asarray(lengths, dtype=np.int64)
    m = grid.ranks
    rank_tokens_cap = grid.rows_per_rank * grid.row_capacity
    costs = cost.of(lengths)
    if len(lengths) == 0:
        return greedy(lengths, grid, cost)
    # a partial partition: (slot costs sorted descending, slot token counts, slot piece lists)
    heap = []
    for i in np.argsort(-costs, kind="stable").tolist():
        slot_cost = np.zeros(m)
        slot_cost[0] = costs[i]
        slot_tokens = np.zeros(m, dtype=np.int64)
        slot_tokens[0] = lengths[i]
        members: list[list[int]] = [[i]] + [[] for _ in range(m - 1)]
        heap.append((-float(costs[i]), i, slot_cost, slot_tokens, members))
    heapq.heapify(heap)
    while len(heap) > 1:
        _, tie_a, ca, ta, ma = heapq.heappop(heap)
        _, tie_b, cb, tb, mb = heapq.heappop(heap)
        # heaviest of a with lightest of b: a is sorted descending; b reversed is ascending
        c = ca + cb[::-1]
        t = ta + tb[::-1]
        members = [ma[k] + mb[m - 1 - k] for k in range(m)]
        order = np.argsort(-c, kind="stable")
        c, t = c[order], t[order]
        members = [members[k] for k in order.tolist()]
        heapq.heappush(heap, (-float(c[0] - c[-1]), min(tie_a, tie_b), c, t, members))
    _, _, slot_cost, slot_tokens, members = heap[0]
    # slots -> ranks: the heaviest slot to rank 0 is arbitrary but deterministic
    rank_of = np.empty(len(lengths), dtype=np.int64)
    for r, mem in enumerate(members):
        rank_of[mem] = r
    return _place_by_rank(lengths, rank_of, grid, cost, rank_tokens_cap)


def _place_by_rank(lengths: np.ndarray, rank_of: np.ndarray, grid: Grid, cost: Cost, cap: int) -> Layout:
    """Rows for pieces already given a rank. Pieces of ranks over their token capacity (or that
    do not fit any row of their rank) go back to a queue placed by the greedy rule."""
    rows = _Rows(grid, cost)
    leftover: list[int] = []
    for i in np.lexsort((-lengths, rank_of)).tolist():  # per rank, longest first
        n = int(lengths[i])
        rank = int(rank_of[i])
        row = rows.fitting_row(rank, n)
        if row < 0:
            leftover.append(i)
            continue
        rows.place(i, 0, n, row)
    if leftover:
        return greedy_exact(lengths, grid, cost, rows, leftover)
    return rows.result()


def in_order(lengths: np.ndarray, grid: Grid) -> Layout:
    """The conventional loader: pieces in arrival order fill rows of seq_len one after another
    (the stream is cut at row boundaries), rows in rank-major order."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n_rows = grid.ranks * grid.rows_per_rank
    row_len = -(-int(lengths.sum()) // n_rows) if n_rows else 0  # tokens spread evenly over rows
    ends = np.cumsum(lengths)
    starts = ends - lengths
    cuts = np.arange(1, n_rows, dtype=np.int64) * row_len
    # every cut inside a piece splits it: fragment boundaries are the union of piece starts and cuts
    bounds = np.union1d(np.concatenate([starts, [int(ends[-1]) if len(ends) else 0]]), cuts)
    bounds = bounds[bounds <= (ends[-1] if len(ends) else 0)]
    frag_start, frag_end = bounds[:-1], bounds[1:]
    piece = np.searchsorted(ends, frag_start, side="right")
    return Layout(piece, frag_start - starts[piece], frag_end - frag_start,
                  np.minimum(frag_start // max(row_len, 1), n_rows - 1))


def costs_dealt_in_order(lengths: Sequence[int], n_bins: int, capacity: int, quadratic: "float | np.ndarray",
                         linear: "float | np.ndarray") -> list[float]:
    """Per-bin cost of the conventional loader's dealing: the pieces in arrival order, the stream
    cut into consecutive bins of `capacity` tokens (a piece may straddle one cut: no piece is
    longer than a bin). The coefficients are floats, or arrays with one per piece."""
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
    costs = list(costs)
    mean = sum(costs) / len(costs) if costs else 0.0
    return max(costs) / mean if mean > 0 else 1.0
