"""Layout methods on synthetic piece lengths: the greedy against a plainly written reference,
splitting, the arrival-order baseline, slack, and Karmarkar-Karp."""

import numpy as np
import pytest

from coordinator.balance import (Cost, Grid, costs_dealt_in_order, greedy, greedy_exact, imbalance, in_order,
                                 karmarkar_karp)

SQUARE = Cost(1.0, 0.0)


def _fill(rng, total, cap):
    lengths, left = [], total
    while left:
        n = min(left, int(rng.integers(1, cap + 1)))
        lengths.append(n)
        left -= n
    return np.array(lengths)


def _reference(lengths, grid):
    """The greedy rule written plainly: longest first; the cheapest rank having a row with room for
    the whole piece (lowest index on ties), in it the cheapest micro-batch then row that fits;
    otherwise the head fills the roomiest row of the rank with the most room in one row."""
    rpr, mbs = grid.rows_per_rank, grid.micro_batch_size
    room = [grid.row_capacity] * (grid.ranks * rpr)
    row_cost = [0.0] * len(room)
    mb_cost = [0.0] * (len(room) // mbs)
    rank_cost = [0.0] * grid.ranks
    queue = sorted(((-int(n), i, i, 0) for i, n in enumerate(lengths)))
    out = []
    while queue:
        neg, tie, i, off = queue.pop(0)
        n = -neg
        rank_room = [max(room[r * rpr:(r + 1) * rpr]) for r in range(grid.ranks)]
        fits = [r for r in range(grid.ranks) if rank_room[r] >= n]
        if fits:
            r = min(fits, key=lambda r: (rank_cost[r], r))
            rows = [x for x in range(r * rpr, (r + 1) * rpr) if room[x] >= n]
            row = min(rows, key=lambda x: (mb_cost[x // mbs], row_cost[x], x))
            take = n
        else:
            r = max(range(grid.ranks), key=lambda r: (rank_room[r], -r))
            row = max(range(r * rpr, (r + 1) * rpr), key=lambda x: (room[x], -x))
            take = room[row]
            queue.append((-(n - take), tie, i, off + take))
            queue.sort()
        out.append((i, off, take, row))
        c = float(take * take)
        room[row] -= take
        row_cost[row] += c
        mb_cost[row // mbs] += c
        rank_cost[r] += c
    out.sort(key=lambda t: t[3])  # stable: placement order within a row
    return out


@pytest.mark.parametrize("rows", [(1, 1), (3, 1), (2, 2)])
def test_exact_greedy_matches_the_plain_reference(rows):
    rng = np.random.default_rng(11)
    n_mb, mbs = rows
    for trial in range(40):
        grid = Grid(int(rng.integers(1, 9)), n_mb, mbs, int(rng.integers(50, 400)))
        lengths = _fill(rng, grid.ranks * grid.rows_per_rank * grid.row_capacity, grid.row_capacity)
        lay = greedy_exact(lengths, grid, SQUARE)
        ours = list(zip(lay.piece.tolist(), lay.offset.tolist(), lay.length.tolist(), lay.row.tolist()))
        assert ours == _reference(lengths, grid), trial


def test_greedy_splits_only_when_nothing_fits():
    lay = greedy_exact(np.array([300, 300, 300, 100]), Grid(2, 1, 1, 500), SQUARE)
    assert np.bincount(lay.row, weights=lay.length).tolist() == [500, 500]
    assert len(lay.piece) == 5  # exactly one of the 300s is split to make both rows exact
    split = [(o, n) for p, o, n in zip(lay.piece.tolist(), lay.offset.tolist(), lay.length.tolist()) if p == 2]
    assert sorted(split) in ([(0, 200), (200, 100)], [(0, 100), (100, 200)])


def test_rank_costs_come_from_the_fragments():
    lengths = np.array([400, 300, 200, 100])
    grid = Grid(2, 1, 1, 500)
    lay = greedy(lengths, grid, Cost(2.0, 3.0))
    expect = np.zeros(2)
    for n, row in zip(lay.length.tolist(), lay.row.tolist()):
        expect[row] += 2.0 * n * n + 3.0 * n
    assert lay.rank_costs(grid, Cost(2.0, 3.0)).tolist() == expect.tolist()


def test_in_order_fills_rows_one_after_another():
    lay = in_order(np.array([300, 400, 300]), Grid(2, 1, 1, 500))
    assert list(zip(lay.piece.tolist(), lay.offset.tolist(), lay.length.tolist(), lay.row.tolist())) == [
        (0, 0, 300, 0), (1, 0, 200, 0), (1, 200, 200, 1), (2, 0, 300, 1)]


def test_dealing_in_order_cuts_the_stream():
    assert costs_dealt_in_order([300, 400, 300], 2, 500, 1.0, 0.0) == [300**2 + 200**2, 200**2 + 300**2]
    assert costs_dealt_in_order([500, 500], 2, 500, 1.0, 2.0) == [500**2 + 1000, 500**2 + 1000]


def _long_tailed(rng, total, seq_len):
    lengths, left = [], total
    while left:
        n = min(left, seq_len, int(rng.pareto(1.1) * 300 + 20))
        lengths.append(n)
        left -= n
    return np.array(lengths)


def test_slack_brings_greedy_to_the_lower_bound():
    rng = np.random.default_rng(3)
    seq_len, ranks, rows = 4096, 16, 4
    ratios = {0.0: [], 0.5: []}
    for _ in range(10):
        lengths = _long_tailed(rng, ranks * rows * seq_len, seq_len)
        costs = SQUARE.of(lengths)
        bound = max(costs.sum() / ranks, costs.max())
        for slack in ratios:
            grid = Grid(ranks, rows, 1, int(seq_len * (1 + slack)))
            lay = greedy(lengths, grid, SQUARE)
            assert lay.length.sum() == lengths.sum()
            ratios[slack].append(lay.rank_costs(grid, SQUARE).max() / bound)
    assert np.mean(ratios[0.5]) <= 1.03
    assert np.mean(ratios[0.5]) <= np.mean(ratios[0.0])


def test_karmarkar_karp_balances_at_least_as_well_as_dealing():
    rng = np.random.default_rng(5)
    seq_len, ranks, rows = 2048, 8, 4
    for _ in range(5):
        lengths = _long_tailed(rng, ranks * rows * seq_len, seq_len)
        grid = Grid(ranks, rows, 1, int(seq_len * 1.5))
        lay = karmarkar_karp(lengths, grid, SQUARE)
        assert lay.length.sum() == lengths.sum()
        assert np.bincount(lay.row, weights=lay.length).max() <= grid.row_capacity
        kk = imbalance(lay.rank_costs(grid, SQUARE).tolist())
        dealt = imbalance(costs_dealt_in_order(lengths, ranks, rows * seq_len, 1.0, 0.0))
        assert kk <= dealt


def _valid(lay, lengths, grid):
    """Every token of every piece placed exactly once, no row over capacity."""
    assert (lay.length > 0).all()
    assert np.bincount(lay.row, weights=lay.length, minlength=grid.ranks * grid.rows_per_rank).max() \
        <= grid.row_capacity
    for i, n in enumerate(lengths.tolist()):
        parts = sorted(zip(lay.offset[lay.piece == i].tolist(), lay.length[lay.piece == i].tolist()))
        at = 0
        for off, m in parts:
            assert off == at
            at += m
        assert at == n, (i, parts)


@pytest.mark.parametrize("ranks,n_mb,mbs,slack", [(2, 8, 1, 0.0), (64, 2, 1, 0.0), (64, 2, 1, 0.5),
                                                  (16, 4, 2, 0.0), (512, 2, 1, 0.5)])
def test_fast_greedy_is_valid_and_as_balanced_as_the_exact_one(ranks, n_mb, mbs, slack):
    rng = np.random.default_rng(ranks)
    seq_len = 4096
    for _ in range(3):
        lengths = _long_tailed(rng, ranks * n_mb * mbs * seq_len, seq_len)
        grid = Grid(ranks, n_mb, mbs, int(seq_len * (1 + slack)))
        fast, exact = greedy(lengths, grid, SQUARE), greedy_exact(lengths, grid, SQUARE)
        _valid(fast, lengths, grid)
        fast_imb = imbalance(fast.rank_costs(grid, SQUARE).tolist())
        exact_imb = imbalance(exact.rank_costs(grid, SQUARE).tolist())
        assert fast_imb <= exact_imb * 1.02 + 0.005, (fast_imb, exact_imb)


@pytest.mark.parametrize("method", ["greedy", "greedy_exact", "karmarkar_karp"])
def test_image_patches_enter_the_cost_and_the_balance(method):
    """Text and image-text pieces of the same lengths: only the patch terms tell them apart. A
    planner blind to them piles the images up; with them, each rank gets its share."""
    from coordinator.balance import layout

    grid = Grid(ranks=4, micro_batches=1, micro_batch_size=2, row_capacity=1000)
    lengths = np.full(16, 500)  # two pieces fill a row exactly
    ratio = np.zeros(len(lengths))
    ratio[1::2] = 0.9  # every other piece is an image-text sample: 90 % placeholders
    vision = Cost(1.0, 0.0, ratio, patch_quadratic=20.0, patch_linear=0.0)
    true = layout(method, lengths, grid, vision)
    blind = layout(method, lengths, grid, SQUARE)
    assert int(true.length.sum()) == int(lengths.sum())
    with_patches = imbalance(true.rank_costs(grid, vision))
    blind_cost = imbalance(blind.rank_costs(grid, vision))  # the blind layout, charged what it really costs
    assert with_patches < 1.01 < 1.3 < blind_cost
    # a piece's cost is a*len^2 + c*(ratio*len)^2
    i = 1
    assert vision.of(lengths[[i]], np.array([i]))[0] == pytest.approx(
        lengths[i] ** 2 + 20.0 * (0.9 * lengths[i]) ** 2)


def test_dealt_in_order_charges_per_piece_coefficients():
    q = np.array([1.0, 3.0])
    costs = costs_dealt_in_order([4, 4], 2, 4, q, np.zeros(2))
    assert costs == [16.0, 48.0]


def _random_step(rng, grid, fill=1.0):
    """Long-tailed piece lengths (at most a row) holding `fill` of the grid's tokens."""
    lengths, left = [], int(grid.ranks * grid.rows_per_rank * grid.row_capacity * fill)
    while left > 0:
        n = min(left, grid.row_capacity, int(rng.pareto(1.2) * 100 + 10))
        lengths.append(n)
        left -= n
    return np.array(lengths)


def test_compiled_loop_matches_the_python_reference():
    """coordinator._greedy (C) and balance._greedy_loop_py run the same rule: the same fragments in
    the same order and the same costs, on grids with micro-batches, caps, per-piece (image)
    coefficients, linear-only costs, and each rank's pieces on its own rows (groups)."""
    from coordinator.balance import COMPILED, _greedy_loop, _State

    assert COMPILED, "coordinator._greedy was not built (setup.py): the planner falls back to Python"
    rng = np.random.default_rng(17)
    for trial in range(120):
        grid = Grid(int(rng.integers(1, 12)), int(rng.integers(1, 4)), int(rng.integers(1, 3)),
                    int(rng.integers(200, 3000)))
        lengths = _random_step(rng, grid, rng.uniform(0.5, 1.0))
        kind = trial % 3
        if kind == 0:
            cost = Cost(1.0, 2.0, rng.uniform(0, 1, len(lengths)) * (rng.random(len(lengths)) < 0.3), 20.0, 3.0)
        else:
            cost = Cost(float(rng.choice([1.0, 2.5, 0.0])), float(rng.choice([0.0, 3.0])) or 1.0)
        costs = cost.of(lengths)
        cap = float(rng.choice([np.inf, max(costs.sum() / grid.ranks, costs.max())]))
        groups = None
        if trial % 4 == 3:  # each rank's share of the pieces, on its own rows
            share = rng.integers(0, grid.ranks, len(lengths))
            lengths = np.concatenate([lengths[share == r][:grid.rows_per_rank] for r in range(grid.ranks)])
            groups = np.concatenate([[0], np.cumsum([min(int((share == r).sum()), grid.rows_per_rank)
                                                     for r in range(grid.ranks)])])
            cost = Cost(cost.quadratic, cost.linear)
        results = []
        for compiled in (True, False):
            state = _State(grid, cost)
            _greedy_loop(state, np.arange(len(lengths)), np.zeros(len(lengths), dtype=np.int64), lengths, cap,
                         groups, compiled=compiled)
            results.append((state.fragments(), state.room, state.row_cost, state.mb_cost, state.rank_cost))
        for c, py in zip(*results):
            assert np.array_equal(c, py), trial


@pytest.mark.parametrize("slack", [0.0, 0.5])
def test_greedy_is_never_slower_than_the_plain_greedy_over_ranks(slack):
    """The busiest rank of the default layout costs at most what it costs under the plain
    longest-first greedy over whole ranks (no rows, no cutting for balance)."""
    rng = np.random.default_rng(23)
    for _ in range(30):
        ranks, rows, seq_len = int(rng.integers(2, 40)), int(rng.integers(1, 5)), int(rng.integers(256, 4096))
        lengths = _random_step(rng, Grid(ranks, rows, 1, seq_len))
        grid = Grid(ranks, rows, 1, int(seq_len * (1 + slack)))
        ours = greedy(lengths, grid, SQUARE)
        _valid(ours, lengths, grid)
        plain = greedy_exact(lengths, Grid(ranks, 1, 1, rows * grid.row_capacity), SQUARE)
        assert ours.rank_costs(grid, SQUARE).max() <= plain.rank_costs(Grid(ranks, 1, 1, 0), SQUARE).max() * (1 + 1e-12)


def test_dense_pieces_are_halved_when_the_tokens_do_not_fit_beside_them():
    """Many full-length pieces and a mass of short ones, with slack: a full piece holds about the
    mean cost of a rank with a third of its tokens, so the short pieces cannot all fit on the other
    ranks. The greedy alone piles them on top of full pieces (well past the lower bound); halving
    the densest full pieces first brings the busiest rank within 3 % of it."""
    rng = np.random.default_rng(29)
    ranks, seq_len, slack = 64, 4096, 0.5
    grid = Grid(ranks, 2, 1, int(seq_len * (1 + slack)))
    full = np.full(55, seq_len)  # 86 % of the ranks, as 4M-token steps of a 40 % long-document source at DP=512
    short = np.clip(rng.lognormal(5.0, 0.95, 40_000), 10, seq_len - 1).astype(np.int64)  # paragraph-like
    short = short[np.cumsum(short) <= ranks * 2 * seq_len - full.sum()]
    lengths = np.concatenate([full, short])
    costs = SQUARE.of(lengths)
    bound = max(costs.sum() / ranks, costs.max())
    lay = greedy(lengths, grid, SQUARE)
    _valid(lay, lengths, grid)
    halved = {int(p) for p, o, n in zip(lay.piece, lay.offset, lay.length) if p < len(full) and o == seq_len // 2}
    alone = greedy_exact(lengths, grid, SQUARE, cost_cap=bound * 1.005)
    assert alone.rank_costs(grid, SQUARE).max() / bound > 1.03
    assert lay.rank_costs(grid, SQUARE).max() / bound <= 1.03
    assert halved  # some full pieces were cut in two, at their middle


def test_the_encoders_quadratic_term_is_per_image():
    """Two images of 100 patches in one 50-token piece attend within each image: 2 x 100^2, not
    200^2 as one image of 200 would; without per-image squares a piece counts as one image."""
    from coordinator.balance import patch_ratio, patch_square_ratio

    lengths = np.array([50.0, 50.0])
    ratio = patch_ratio(np.array([200, 200]), lengths)
    squares = patch_square_ratio(np.array([2 * 100 ** 2, 200 ** 2]), lengths)
    per_image = Cost(0.0, 0.0, ratio, 1.0, 0.0, squares)
    assert per_image.of(lengths).tolist() == [20000.0, 40000.0]
    assert Cost(0.0, 0.0, ratio, 1.0, 0.0).of(lengths).tolist() == [40000.0, 40000.0]
