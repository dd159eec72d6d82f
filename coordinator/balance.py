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
  Pieces that no layout could balance whole are cut first (see `greedy`), and the result is never
  worse than the plain greedy over ranks.
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

from msd_common.job_keys import METHODS


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
    patch_quadratic*(its images' patches squared, summed) + patch_linear*patches. A piece's
    patches are taken as patch_ratio[piece] x its length and its squares as
    patch_square_ratio[piece] x its length squared (exact for a whole document; a fragment of a
    split one is charged its share), so every piece has its own quadratic and linear coefficient."""

    quadratic: float
    linear: float
    patch_ratio: "np.ndarray | None" = None  # per piece of the step: patches per token; None: text only
    patch_quadratic: float = 0.0
    patch_linear: float = 0.0
    # per piece: its images' patches squared, summed, per token squared; None: patch_ratio squared
    # (one image a piece). The vision encoder attends within each image, not across a sample's.
    patch_square_ratio: "np.ndarray | None" = None

    def coefficients(self, pieces: np.ndarray) -> tuple:
        """(quadratic, linear) of the given pieces: floats for a text-only step, else arrays."""
        if self.patch_ratio is None:
            return self.quadratic, self.linear
        r = self.patch_ratio[pieces]
        r2 = r * r if self.patch_square_ratio is None else self.patch_square_ratio[pieces]
        return self.quadratic + self.patch_quadratic * r2, self.linear + self.patch_linear * r

    def of(self, lengths: np.ndarray, pieces: "np.ndarray | None" = None) -> np.ndarray:
        """Cost of fragments of the given lengths, of the given pieces (default: piece i is fragment i)."""
        lengths = np.asarray(lengths, dtype=np.float64)
        q, lin = self.coefficients(np.arange(len(lengths)) if pieces is None else pieces)
        return q * lengths * lengths + lin * lengths


def patch_ratio(patches: np.ndarray, doc_lengths: np.ndarray) -> np.ndarray:
    """Patches per token of image records: a piece of `n` tokens of such a record is charged n x
    its ratio patches (Cost.patch_ratio). Built-in patches have a placeholder token each (ratio at
    most 1); a processor's image token stands for several patches (Qwen-VL: merge_size^2)."""
    return np.asarray(patches, dtype=np.float64) / np.maximum(doc_lengths, 1)


def patch_square_ratio(squares: np.ndarray, doc_lengths: np.ndarray) -> np.ndarray:
    """Images' patches squared, summed, per token squared (Cost.patch_square_ratio)."""
    n = np.maximum(np.asarray(doc_lengths, dtype=np.float64), 1.0)
    return np.asarray(squares, dtype=np.float64) / (n * n)


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


MIN_SPLIT = 128  # no piece is cut for balance into parts shorter than this
CAP_MARGIN = 0.005  # pieces are cut for balance only past the lower bound plus this

try:  # the inner loop, compiled (setup.py); the same rule as _greedy_loop_py, which stands in without it
    from . import _greedy as _compiled
except ImportError:  # pragma: no cover - a build without a C compiler
    _compiled = None
try:  # whole samples' placing and exchanges, compiled (setup.py); _place_whole and _exchange_rounds stand in
    from . import _whole as _compiled_whole
except ImportError:  # pragma: no cover - a build without a C compiler
    _compiled_whole = None
COMPILED = _compiled is not None and _compiled_whole is not None


class _State:
    """Rows of every rank with their room and costs, and the fragments placed so far."""

    def __init__(self, grid: Grid, cost: Cost) -> None:
        self.grid, self.cost = grid, cost
        n_rows = grid.ranks * grid.rows_per_rank
        self.room = np.full(n_rows, grid.row_capacity, dtype=np.int64)
        self.row_cost = np.zeros(n_rows)
        self.mb_cost = np.zeros(grid.ranks * grid.micro_batches)
        self.rank_cost = np.zeros(grid.ranks)
        self.frags: list[np.ndarray] = []  # [piece, offset, length, row] blocks, in placement order

    def fitting_row(self, rank: int, length: int) -> int:
        rpr = self.grid.rows_per_rank
        return _fitting_row(self.room, self.row_cost, self.mb_cost, rank * rpr, rpr, self.grid.micro_batch_size,
                            length)

    def place(self, piece: int, offset: int, length: int, row: int) -> None:
        q, lin = self.cost.coefficients(np.array([piece]))
        c = float(np.asarray(q * length * length + lin * length).ravel()[0])
        self.room[row] -= length
        self.row_cost[row] += c
        self.mb_cost[row // self.grid.micro_batch_size] += c
        self.rank_cost[row // self.grid.rows_per_rank] += c
        self.frags.append(np.array([[piece, offset, length, row]], dtype=np.int64))

    def fragments(self) -> np.ndarray:
        """[piece, offset, length, row] of every fragment, in placement order."""
        return np.concatenate(self.frags) if self.frags else np.zeros((0, 4), dtype=np.int64)

    def result(self) -> Layout:
        a = self.fragments()
        a = a[_stable_argsort(a[:, 3])]  # rows in order; fragments in placement order within a row
        return Layout(a[:, 0], a[:, 1], a[:, 2], a[:, 3])


def greedy(lengths: np.ndarray, grid: Grid, cost: Cost) -> Layout:
    """The default method: the longest-first greedy (module docstring), with two additions.

    1. The level no rank can beat is the larger of the mean cost and the costliest piece. A piece
       that would take even the cheapest rank past it (plus CAP_MARGIN) is cut, its head bringing
       that rank to the level. And when the pieces costing over half the level are so dense (cost
       per token) that the ranks holding them could not leave room for the other tokens without
       going past it, the densest of them are halved first (_dense_pieces_to_halve).
    2. The plain greedy over ranks (a rank's rows taken as one bin of their tokens), its ranks'
       pieces then laid on their rows, is the other candidate; the layout whose busiest rank costs
       less is kept, so cutting never makes a step slower than the plain greedy would."""
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_fits(lengths, grid)
    n = len(lengths)
    if not n:
        return _State(grid, cost).result()
    costs = cost.of(lengths)
    level = max(float(costs.sum()) / grid.ranks, float(costs.max())) * (1 + CAP_MARGIN)
    text = cost.patch_ratio is None  # else image-text pieces: cost is not a function of length alone
    order = _greedy_order(lengths if text else costs)
    halve = _dense_pieces_to_halve(lengths, costs, grid, level, order, text)
    cut = _State(grid, cost)
    if len(halve):
        parts = np.ones(n, dtype=np.int64)
        parts[halve] = 2
        piece = np.repeat(np.arange(n), parts)
        offset = np.zeros(len(piece), dtype=np.int64)
        length = lengths[piece]
        second = np.cumsum(parts)[halve] - 1  # where each halved piece's second half is
        offset[second] = lengths[halve] // 2
        length[second - 1] = offset[second]
        length[second] -= offset[second]
        frag_order = _greedy_order(length if text else cost.of(length, piece))
        _greedy_loop(cut, piece[frag_order], offset[frag_order], length[frag_order], level)
    else:
        _greedy_loop(cut, order, np.zeros(n, dtype=np.int64), lengths[order], level)
    plain = _plain_then_rows(lengths, grid, cost, order)
    return (cut if cut.rank_cost.max() <= plain.rank_cost.max() else plain).result()


def _plain_then_rows(lengths: np.ndarray, grid: Grid, cost: Cost, order: np.ndarray) -> _State:
    """The plain greedy over ranks, each holding its rows' tokens, then every rank's pieces on its
    own rows by the same rule (cutting across rows, if needed, only lowers a rank's cost).
    `order`: the pieces in greedy order."""
    by_rank = _State(Grid(grid.ranks, 1, 1, grid.rows_per_rank * grid.row_capacity), cost)
    _greedy_loop(by_rank, order, np.zeros(len(lengths), dtype=np.int64), lengths[order])
    frags = by_rank.fragments()  # placed in greedy order, so each rank's are in greedy order too
    frags = frags[_stable_argsort(frags[:, 3])]
    bounds = np.searchsorted(frags[:, 3], np.arange(grid.ranks + 1))
    rows = _State(grid, cost)
    _greedy_loop(rows, frags[:, 0], frags[:, 1], frags[:, 2], groups=bounds)
    return rows


def _greedy_order(keys: np.ndarray) -> np.ndarray:
    """Fragments in greedy order: by key, largest first (the length, or for a step with image-text
    pieces, whose cost is not a function of length alone, the cost), ties in their given order
    (by piece, then offset)."""
    if keys.dtype.kind in "iu":
        return _stable_argsort(keys.max() - keys) if len(keys) else np.zeros(0, dtype=np.int64)
    return np.argsort(-keys, kind="stable")


def _stable_argsort(values: np.ndarray) -> np.ndarray:
    """np.argsort(kind="stable"), by radix sort when the values are small non-negative integers
    (ranks, rows, lengths): several times faster on the planner's arrays."""
    if values.dtype.kind in "iu" and len(values) and values.min() >= 0 and values.max() < 1 << 16:
        values = values.astype(np.uint16)
    return np.argsort(values, kind="stable")


def _dense_pieces_to_halve(lengths: np.ndarray, costs: np.ndarray, grid: Grid, level: float,
                           order: np.ndarray, cost_per_token_follows_length: bool) -> np.ndarray:
    """Pieces to cut in two before the layout, densest first, as few as the step's tokens allow.

    A rank can hold one piece costing over half the level (a dominant piece); what it can add is
    bounded by the cost left below the level and by its token room. The other pieces' tokens must
    fit: at best the ranks with a dominant piece take the least dense of them, up to the cost they
    have left, and every other rank takes a full rank of tokens. When that cannot hold (a step with
    many long, dense pieces and little token slack), the densest dominant pieces are halved: each
    half costs a quarter, so the halves spread over ranks that still have room. `order`: the
    pieces in greedy order, which for text (cost per token growing with length) also orders
    them by density."""
    capacity = grid.rows_per_rank * grid.row_capacity  # tokens per rank
    dominant = np.flatnonzero((costs > level / 2) & (lengths >= 2 * MIN_SPLIT))
    if not len(dominant) or len(dominant) > grid.ranks:
        return np.zeros(0, dtype=np.int64)
    dominant = dominant[np.argsort(-costs[dominant] / lengths[dominant], kind="stable")]  # densest first
    others = np.ones(len(lengths), dtype=bool)
    others[dominant] = False
    if cost_per_token_follows_length:  # text: cost per token grows with length, so `order` reversed
        reverse = order[::-1]
        thin = reverse[others[reverse]]
    else:
        thin = np.flatnonzero(others)
        thin = thin[np.argsort(costs[thin] / np.maximum(lengths[thin], 1), kind="stable")]  # least dense first
    thin_cost = np.concatenate([[0.0], np.cumsum(costs[thin])])
    thin_tokens = np.concatenate([[0], np.cumsum(lengths[thin])])
    other_tokens = int(lengths[others].sum())
    d_len, d_cost = lengths[dominant], costs[dominant]
    # with the k densest halved (k = 0..D): cost and token room left beside the dominant pieces kept
    cost_room = np.concatenate([np.cumsum((level - d_cost)[::-1])[::-1], [0.0]])
    token_room = np.concatenate([np.cumsum((capacity - d_len)[::-1])[::-1], [0]])
    halved_tokens = np.concatenate([[0], np.cumsum(d_len)])
    beside = np.minimum(thin_tokens[np.searchsorted(thin_cost, cost_room, side="right") - 1], token_room)
    free_ranks = grid.ranks - (len(dominant) - np.arange(len(dominant) + 1))
    fits = other_tokens + halved_tokens - beside <= free_ranks * capacity
    k = int(np.argmax(fits)) if fits.any() else len(dominant)
    return np.sort(dominant[:k])


def _check_fits(lengths: np.ndarray, grid: Grid) -> None:
    if int(lengths.sum()) > grid.ranks * grid.rows_per_rank * grid.row_capacity:
        raise ValueError(f"{int(lengths.sum())} tokens do not fit {grid.ranks} ranks x {grid.rows_per_rank} rows "
                         f"of {grid.row_capacity}")


def greedy_exact(lengths: np.ndarray, grid: Grid, cost: Cost, state: "_State | None" = None,
                 pieces: "np.ndarray | list[int] | None" = None, cost_cap: float = math.inf) -> Layout:
    """The greedy rule alone, over whole pieces (the module docstring). `state` and `pieces`
    continue a partial layout with the given pieces; `cost_cap` as in _greedy_loop."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if state is None:
        _check_fits(lengths, grid)
        state = _State(grid, cost)
        pieces = np.arange(len(lengths))
    pieces = np.asarray(pieces, dtype=np.int64)
    _greedy_loop(state, pieces, np.zeros(len(pieces), dtype=np.int64), lengths[pieces], cost_cap)
    return state.result()


def _greedy_loop(state: _State, piece: np.ndarray, offset: np.ndarray, length: np.ndarray,
                 cost_cap: float = math.inf, groups: "np.ndarray | None" = None,
                 compiled: bool = True) -> None:
    """Lays out fragments (piece, offset within it, length) by the greedy rule, on `state`.

    Costliest fragment first; to the cheapest rank (then lowest index) with a row that has room for
    all of it; in it, the cheapest micro-batch then row with room. If that would take the rank
    past `cost_cap`, the fragment is cut so its head brings the rank to the cap (both parts at
    least MIN_SPLIT) and the rest goes back into the queue. If no rank has room for all of it, its
    head fills the roomiest row of the rank with the roomiest row, the rest goes back. With
    `groups` (bounds of each rank's fragments, which are then in rank order), each rank's
    fragments are laid on its own rows only. Runs compiled where built (compiled=False: the Python
    reference, which gives the same result)."""
    grid, cost = state.grid, state.cost
    arrays = [np.ascontiguousarray(a, dtype=np.int64) for a in (piece, offset, length)]
    if len(arrays[2]) and arrays[2].min() <= 0:
        raise ValueError("fragments to lay out must hold at least one token")
    if cost.patch_ratio is None:
        qs = lins = None
        q, lin = float(cost.quadratic), float(cost.linear)
    else:
        qs, lins = (np.ascontiguousarray(a, dtype=np.float64)
                    for a in cost.coefficients(np.arange(len(cost.patch_ratio))))
        q = lin = 0.0
    if _compiled is not None and compiled:
        room_for = len(piece) + 2 * grid.ranks * (grid.rows_per_rank + 1) + 16  # fragments: pieces plus cuts
        out = np.empty((4, room_for), dtype=np.int64)
        count = _compiled.greedy(*arrays, qs, lins, q, lin,
                                 (grid.ranks, grid.micro_batches, grid.micro_batch_size, grid.row_capacity),
                                 state.room, state.row_cost, state.mb_cost, state.rank_cost, float(cost_cap),
                                 None if groups is None else np.ascontiguousarray(groups, dtype=np.int64),
                                 out[0], out[1], out[2], out[3])
        state.frags.append(out[:, :count].T.copy())
        return
    if groups is None:
        state.frags.append(_greedy_loop_py(state, 0, grid.ranks, *(a.tolist() for a in arrays), qs, lins, q, lin,
                                           cost_cap))
        return
    for r in range(grid.ranks):
        lo, hi = int(groups[r]), int(groups[r + 1])
        state.frags.append(_greedy_loop_py(state, r, 1, *(a[lo:hi].tolist() for a in arrays), qs, lins, q, lin,
                                           cost_cap))


_AVAILABLE, _PARKED, _FULL = 0, 1, 2


def _greedy_loop_py(state: _State, first_rank: int, ranks: int, piece: list, offset: list, length: list,
                    qs: "np.ndarray | None", lins: "np.ndarray | None", q: float, lin: float,
                    cost_cap: float) -> np.ndarray:
    """The Python reference of _greedy.c (and the fallback without it), on ranks
    [first_rank, first_rank + ranks) of `state`. Returns the fragments placed."""
    grid = state.grid
    rpr, mbs, n_mb = grid.rows_per_rank, grid.micro_batch_size, grid.micro_batches
    rows = slice(first_rank * rpr, (first_rank + ranks) * rpr)
    room, row_cost = state.room[rows].tolist(), state.row_cost[rows].tolist()
    mb_cost = state.mb_cost[first_rank * n_mb:(first_rank + ranks) * n_mb].tolist()
    rank_cost = state.rank_cost[first_rank:first_rank + ranks].tolist()
    qs = None if qs is None else qs.tolist()
    lins = None if lins is None else lins.tolist()

    def key_of(p: int, n: int) -> float:
        return float(n) if qs is None else qs[p] * n * n + lins[p] * n

    queue = [(-key_of(p, n), p, o, n) for p, o, n in zip(piece, offset, length)]
    heapq.heapify(queue)
    rank_room = [max(room[r * rpr:(r + 1) * rpr]) for r in range(ranks)]
    state_of = [_AVAILABLE if rank_room[r] > 0 else _FULL for r in range(ranks)]
    version = [0] * ranks
    available = [(rank_cost[r], r, 0) for r in range(ranks) if state_of[r] == _AVAILABLE]
    heapq.heapify(available)
    parked: list[tuple[int, int, int]] = []  # (-room, rank, version)
    pop, push, replace = heapq.heappop, heapq.heappush, heapq.heapreplace
    out = []
    while queue:
        _, p, o, n = pop(queue)
        if qs is not None:
            q, lin = qs[p], lins[p]
        while parked and -parked[0][0] >= n:  # ranks with room again for pieces this small
            _, r, v = pop(parked)
            if state_of[r] == _PARKED and v == version[r]:
                state_of[r] = _AVAILABLE
                push(available, (rank_cost[r], r, v))
        rank = -1
        while available:
            _, r, v = available[0]
            if state_of[r] != _AVAILABLE or v != version[r]:
                pop(available)  # stale entry
            elif rank_room[r] >= n:
                rank = r
                break
            else:
                pop(available)
                state_of[r] = _PARKED
                push(parked, (-rank_room[r], r, v))
        from_top = rank >= 0
        if from_top:
            take = n
            over = rank_cost[rank] + q * float(n) * float(n) + lin * float(n) - cost_cap
            if over > 0 and n >= 2 * MIN_SPLIT:
                head = _head_for(cost_cap - rank_cost[rank], q, lin)
                if MIN_SPLIT <= head <= n - MIN_SPLIT:
                    take = head
                    push(queue, (-key_of(p, n - take), p, o + take, n - take))
            row = _fitting_row(room, row_cost, mb_cost, rank * rpr, rpr, mbs, take)
        else:  # no rank has room for all of it: its head fills the roomiest row of the roomiest rank
            while parked and (state_of[parked[0][1]] != _PARKED or parked[0][2] != version[parked[0][1]]):
                pop(parked)
            if not parked:
                raise ValueError("pieces hold more tokens than the rows")
            rank = parked[0][1]
            row = max(range(rank * rpr, (rank + 1) * rpr), key=lambda r: (room[r], -r))
            take = room[row]
            push(queue, (-key_of(p, n - take), p, o + take, n - take))
        out.append((p, o, take, (first_rank * rpr) + row))
        c = q * float(take) * float(take) + lin * float(take)
        room[row] -= take
        row_cost[row] += c
        mb_cost[row // mbs] += c
        rank_cost[rank] += c
        rank_room[rank] = room[row] if rpr == 1 else max(room[rank * rpr:(rank + 1) * rpr])
        version[rank] += 1
        if rank_room[rank] == 0:  # the placed rank's entry is its heap's top: replace it in place
            state_of[rank] = _FULL
            pop(available if from_top else parked)
        elif from_top:
            replace(available, (rank_cost[rank], rank, version[rank]))
        else:
            replace(parked, (-rank_room[rank], rank, version[rank]))
    state.room[rows], state.row_cost[rows] = room, row_cost
    state.mb_cost[first_rank * n_mb:(first_rank + ranks) * n_mb] = mb_cost
    state.rank_cost[first_rank:first_rank + ranks] = rank_cost
    return np.array(out, dtype=np.int64).reshape(-1, 4)


def _fitting_row(room, row_cost, mb_cost, first: int, rows: int, mbs: int, length: int) -> int:
    """Of rows [first, first + rows), the one to take a piece of `length`: the cheapest
    micro-batch, then the cheapest row, among rows with room for it (-1 if none)."""
    fits = [(mb_cost[r // mbs], row_cost[r], r) for r in range(first, first + rows) if room[r] >= length]
    return min(fits)[2] if fits else -1


def _head_for(budget: float, q: float, lin: float) -> int:
    """The longest length h with q*h^2 + lin*h <= budget."""
    if budget <= 0:
        return 0
    if q > 0:
        return int((-lin + math.sqrt(lin * lin + 4 * q * budget)) / (2 * q))
    return int(budget / lin) if lin > 0 else 1 << 62


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
    rows = _State(grid, cost)
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


def whole_layout(lengths: np.ndarray, whole: np.ndarray, grid: Grid, cost: Cost,
                 first: np.ndarray | None = None, budget: int | None = None) -> tuple[Layout, np.ndarray]:
    """A layout in which the pieces flagged `whole` are never cut (samples of `packing: whole`
    sources), and the pieces that do not fit. Whole pieces, costliest first, go to the cheapest
    rank that has a row with room for them, into its tightest such row (best fit); those flagged
    `first` (left out by an earlier step) go before all others. A whole piece no row has room
    for, or that would take the step past `budget` real tokens, is returned in `deferred` (the
    planner draws it first in the next step).
    The other pieces (pretraining text) then fill what room is left, costliest first, on the
    cheapest rank with room, cut at a row's end where they must be. Rows are padded."""
    lengths = np.asarray(lengths, dtype=np.int64)
    whole = np.asarray(whole, dtype=bool)
    ranks, per_rank, cap = grid.ranks, grid.rows_per_rank, grid.row_capacity
    piece_cost = cost.of(lengths)
    free = np.full((ranks, per_rank), cap, dtype=np.int64)
    rank_cost = np.zeros(ranks)
    frag_piece, frag_off, frag_len, frag_row, frag_seq = [], [], [], [], []
    deferred = []
    first = np.zeros(len(lengths), bool) if first is None else np.asarray(first, dtype=bool)
    order = np.lexsort((np.arange(len(lengths)), -piece_cost, ~first))  # left out before, then costliest first
    budget = int(lengths.sum()) if budget is None else int(budget)
    placing = np.ascontiguousarray(order[whole[order]], dtype=np.int64)
    rows_of = _place_whole(lengths, piece_cost, placing, budget, free, rank_cost)
    row_of: dict[int, int] = {}  # whole piece -> its row (rank * per_rank + row), in the order placed
    for i, at in zip(placing.tolist(), rows_of.tolist()):
        if at < 0:
            deferred.append(i)
        else:
            row_of[i] = at
    if row_of:
        _exchange_whole(row_of, lengths, piece_cost, free, rank_cost, cap)
    for i, at in row_of.items():  # a row's samples back to back, in the order they were placed
        frag_piece.append(i)
        frag_off.append(0)
        frag_len.append(int(lengths[i]))
        frag_row.append(at)
    if row_of:
        rows_placed = np.asarray(frag_row, dtype=np.int64)
        lens_placed = np.asarray(frag_len, dtype=np.int64)
        starts = np.zeros(len(rows_placed), dtype=np.int64)
        for at in np.unique(rows_placed).tolist():
            mine = np.flatnonzero(rows_placed == at)
            starts[mine] = np.cumsum(lens_placed[mine]) - lens_placed[mine]
        frag_seq.extend(starts.tolist())
    q, lin = cost.coefficients(np.arange(len(lengths)))
    q = np.broadcast_to(np.asarray(q, dtype=np.float64), lengths.shape)
    lin = np.broadcast_to(np.asarray(lin, dtype=np.float64), lengths.shape)
    queue = [(i, 0, int(lengths[i])) for i in order[~whole[order]].tolist()]
    while queue:
        i, off, n = queue.pop(0)
        fits = free.max(axis=1) > 0
        if not fits.any():
            deferred.append(i)  # no room at all (the draw never takes more tokens than the rows hold)
            continue
        r = int(np.argmin(np.where(fits, rank_cost, np.inf)))
        row = int(np.argmax(free[r]))
        take = min(n, int(free[r, row]))
        frag_piece.append(i)
        frag_off.append(off)
        frag_len.append(take)
        frag_row.append(r * per_rank + row)
        frag_seq.append(cap - int(free[r, row]))
        free[r, row] -= take
        rank_cost[r] += q[i] * take * take + lin[i] * take
        if take < n:
            queue.insert(0, (i, off + take, n - take))
    rows = np.asarray(frag_row, dtype=np.int64)
    at = np.asarray(frag_seq, dtype=np.int64)
    sort = np.lexsort((at, rows))  # delivery order: row, then place in the row
    lay = Layout(np.asarray(frag_piece, dtype=np.int64)[sort], np.asarray(frag_off, dtype=np.int64)[sort],
                 np.asarray(frag_len, dtype=np.int64)[sort], rows[sort])
    return lay, np.asarray(sorted(deferred), dtype=np.int64)


def _place_whole(lengths: np.ndarray, piece_cost: np.ndarray, order: np.ndarray, budget: int, free: np.ndarray,
                 rank_cost: np.ndarray, compiled: bool = True) -> np.ndarray:
    """Whole samples in the given order, each unless it would take the step past `budget` tokens,
    to the cheapest rank (lowest index on ties) with a row that has room for it, into the
    tightest such row: the row of each (rank * rows_per_rank + row), -1 for one left out. In place
    on free [ranks, rows_per_rank] and rank_cost. Runs compiled where built (coordinator/_whole.c;
    compiled=False: this Python reference, the same result)."""
    per_rank = free.shape[1]
    if _compiled_whole is not None and compiled:
        out = np.empty(len(order), dtype=np.int64)
        flat_free = np.ascontiguousarray(free.reshape(-1), dtype=np.int64)
        cost = np.ascontiguousarray(rank_cost, dtype=np.float64)
        _compiled_whole.place(np.ascontiguousarray(lengths, dtype=np.int64),
                              np.ascontiguousarray(piece_cost, dtype=np.float64), order, int(budget), flat_free, cost,
                              per_rank, out)
        free[:] = flat_free.reshape(free.shape)
        rank_cost[:] = cost
        return out
    out = np.full(len(order), -1, dtype=np.int64)
    placed = 0
    for k, i in enumerate(order.tolist()):
        n = int(lengths[i])
        if placed + n > budget:
            continue
        room = free >= n
        fits = room.any(axis=1)
        if not fits.any():
            continue
        r = int(np.argmin(np.where(fits, rank_cost, np.inf)))
        row = int(np.argmin(np.where(room[r], free[r], np.iinfo(np.int64).max)))
        out[k] = r * per_rank + row
        free[r, row] -= n
        placed += n
        rank_cost[r] += piece_cost[i]
    return out


def busiest_rank_bound(lengths: np.ndarray, costs: np.ndarray, rank_tokens: int, padding: int, ranks: int) -> float:
    """A lower bound of the busiest rank's cost for any layout of these whole samples on `ranks`
    ranks of `rank_tokens` each, with `padding` tokens of padding in all (the rest full). For each
    k: either the k costliest samples are on k different ranks, which between them then hold
    k x rank_tokens - padding tokens at least, the rest at best the cheapest per token of the
    other samples (taken fractionally: a relaxation), so the busiest holds at least their mean;
    or two of them share a rank, which then costs at least the two cheapest of them. The larger
    of that and the mean rank cost."""
    n = np.asarray(lengths, dtype=np.float64)
    c = np.asarray(costs, dtype=np.float64)
    by_cost = np.lexsort((np.arange(len(c)), -c))
    by_density = np.argsort(c / np.maximum(n, 1), kind="stable")
    rank_in_cost = np.empty(len(c), dtype=np.int64)
    rank_in_cost[by_cost] = np.arange(len(c))
    fill_n, fill_c, fill_at = n[by_density], c[by_density], rank_in_cost[by_density]
    best = float(c.sum()) / ranks
    top_n = top_c = 0.0
    for k in range(1, min(ranks, len(n)) + 1):
        top_n += n[by_cost[k - 1]]
        top_c += c[by_cost[k - 1]]
        need = k * rank_tokens - top_n - padding
        rest = fill_at >= k  # not among the k costliest
        rn, rc = fill_n[rest], fill_c[rest]
        take = np.clip(need - (np.cumsum(rn) - rn), 0, rn)  # tokens taken of each, cheapest per token first
        spread = (top_c + float((take * rc / np.maximum(rn, 1)).sum())) / k
        paired = c[by_cost[k - 2]] + c[by_cost[k - 1]] if k >= 2 else np.inf
        best = max(best, min(spread, paired))
    return best


SWAP_ROUNDS_PER_RANK = 32  # exchanges made per step at most: this many per rank (a busy rank needs a few)
PAIR_FROM = 8  # a rank's two samples offered for one of the busiest rank's: two of its this many cheapest


def _exchange_whole(row_of: dict[int, int], lengths: np.ndarray, piece_cost: np.ndarray, free: np.ndarray,
                    rank_cost: np.ndarray, row_capacity: int, compiled: bool = True) -> None:
    """Exchanges of whole samples between the busiest rank and another, one of the busiest rank's
    for one or two of the other's, where both rows have room for what they get, while one lowers
    the costlier of the two ranks: with every row full (no token slack), a rank that holds a long
    sample can only become cheaper by trading its other samples for shorter ones of the same
    total. The set of samples, hence padding, does not change. In place on row_of, free and
    rank_cost. Runs compiled where built (coordinator/_whole.c; compiled=False: _exchange_rounds, the
    Python reference, the same result)."""
    pieces = np.fromiter(row_of.keys(), dtype=np.int64, count=len(row_of))
    at = np.fromiter(row_of.values(), dtype=np.int64, count=len(row_of))
    n = np.ascontiguousarray(lengths[pieces], dtype=np.int64)
    c = np.ascontiguousarray(piece_cost[pieces], dtype=np.float64)
    flat_free = free.reshape(-1)
    level = float(rank_cost.mean()) * (1 + CAP_MARGIN)  # nothing to gain below
    per_rank = free.shape[1]
    rounds = SWAP_ROUNDS_PER_RANK * max(len(rank_cost), 2)
    if _compiled_whole is not None and compiled:
        cost = np.ascontiguousarray(rank_cost, dtype=np.float64)
        free_c = np.ascontiguousarray(flat_free, dtype=np.int64)
        _compiled_whole.exchange(n, c, at, free_c, cost, per_rank, int(row_capacity), PAIR_FROM, level, rounds)
        rank_cost[:] = cost
        flat_free[:] = free_c
    else:
        _exchange_rounds(at, n, c, flat_free, rank_cost, per_rank, level, rounds)
    for p in range(len(pieces)):
        row_of[int(pieces[p])] = int(at[p])


def _exchange_rounds(at: np.ndarray, n: np.ndarray, c: np.ndarray, flat_free: np.ndarray, rank_cost: np.ndarray,
                     per_rank: int, level: float, rounds: int) -> int:
    """The exchanges in Python (coordinator/_whole.c states the rule): in place on at,
    flat_free and rank_cost; the number of rounds made."""
    for done in range(rounds):
        rank = at // per_rank
        b = int(np.argmax(rank_cost))
        if rank_cost[b] <= level:
            return done
        mine = np.flatnonzero(rank == b)
        single = _best_exchange(b, mine, np.flatnonzero(rank != b)[:, None], rank, at, n, c, flat_free, rank_cost)
        pair = _best_exchange(b, mine, _cheap_pairs(rank, c, b, len(rank_cost)), rank, at, n, c, flat_free,
                              rank_cost)
        best = single if single is not None and (pair is None or single[3] <= pair[3]) else pair
        if best is None:
            return done
        i, theirs, delta, _ = best
        r = int(rank[theirs[0]])
        row_i, row_j = int(at[i]), int(at[theirs[0]])
        flat_free[row_i] += int(n[i] - n[theirs].sum())  # what the other gives lands in i's row,
        flat_free[row_j] -= int(n[i])  # and i in the row of the first of them
        for t in theirs:
            flat_free[at[t]] += int(n[t])
            at[t] = row_i
        at[i] = row_j
        rank_cost[b] -= delta
        rank_cost[r] += delta
    return rounds


def _best_exchange(b: int, mine: np.ndarray, offers: np.ndarray, rank: np.ndarray, at: np.ndarray, n: np.ndarray,
                   c: np.ndarray, flat_free: np.ndarray, rank_cost: np.ndarray) -> "tuple | None":
    """The exchange of one of `mine` (on the busiest rank b) for one row of `offers` (samples of
    one other rank, -1 for none) that leaves the costlier of the two ranks cheapest, if it is
    cheaper than b now: (sample, offered samples, cost moved, the costlier rank's cost after)."""
    if not len(mine) or not len(offers):
        return None
    valid = offers >= 0
    o = np.where(valid, offers, 0)
    got_n, got_c = (n[o] * valid).sum(axis=1), (c[o] * valid).sum(axis=1)
    first = o[:, 0]
    # the first offered sample's row takes the busiest rank's sample; others offered from that row free room in it
    room = flat_free[at[first]] + (n[o] * (valid & (at[o] == at[first][:, None]))).sum(axis=1)
    delta = c[mine][:, None] - got_c[None, :]
    ok = (delta > 0) & (flat_free[at[mine]][:, None] + n[mine][:, None] >= got_n[None, :]) \
        & (room[None, :] >= n[mine][:, None])
    after = np.where(ok, np.maximum(rank_cost[b] - delta, rank_cost[rank[first]][None, :] + delta), np.inf)
    x, y = divmod(int(np.argmin(after)), after.shape[1])
    if not after[x, y] < rank_cost[b] * (1 - 1e-9):
        return None
    return int(mine[x]), o[y][valid[y]], float(delta[x, y]), float(after[x, y])


def _cheap_pairs(rank: np.ndarray, c: np.ndarray, b: int, ranks: int) -> np.ndarray:
    """Pairs of samples of one rank (not b), two of each rank's PAIR_FROM cheapest: [pairs, 2]."""
    order = np.lexsort((c, rank))
    starts = np.searchsorted(rank[order], np.arange(ranks))
    counts = np.bincount(rank, minlength=ranks)
    cheapest = np.full((ranks, PAIR_FROM), -1, dtype=np.int64)
    for t in range(PAIR_FROM):
        has = counts > t
        cheapest[has, t] = order[starts[has] + t]
    cheapest[b] = -1
    x, y = np.triu_indices(PAIR_FROM, 1)
    pairs = np.stack([cheapest[:, x].reshape(-1), cheapest[:, y].reshape(-1)], axis=1)
    return pairs[(pairs >= 0).all(axis=1)]
