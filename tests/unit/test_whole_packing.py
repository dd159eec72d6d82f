"""`packing: whole`: a whole-sample source's samples are never cut (by a row's end or a step's
end), samples longer than seq_len are truncated or dropped, rows are padded, the mixture holds
in real tokens, and concat sources fill the room left in the same steps."""

import os
import sys
from collections import defaultdict

import numpy as np
import pytest

from coordinator.plan import LENGTH, OFFSET, POSITION, SOURCE, Planner
from tests.conftest import job_dict
from tests.unit.test_plan import COUNTS, Known, _lengths


def _whole_job(dataset_dir, long_docs=None, weights=None, **extra):
    job = job_dict()
    job["sources"]["web"]["packing"] = "whole"
    job["sources"]["long"]["packing"] = "whole"
    if long_docs:
        job["sources"]["web"]["long_docs"] = long_docs
        job["sources"]["long"]["long_docs"] = long_docs
    if weights:
        job["mixture"] = {"weights": weights}
    job.update(extra)
    from msd_common.spec import parse_job
    return parse_job(job, "job.yaml", base_dir=dataset_dir)


def _run(job, steps=40, seed=0):
    planner = Planner(job, COUNTS)
    lengths = _lengths(COUNTS, seed)
    known = Known(planner, lengths)
    return planner, lengths, [planner.plan_step(known) for _ in range(steps)]


def test_whole_samples_are_never_cut_and_long_ones_are_truncated(dataset_dir):
    job = _whole_job(dataset_dir)
    seq_len = job.batch.seq_len
    planner, lengths, plans = _run(job)
    whole = {0, 2}
    seen = 0
    for plan in plans:
        for piece in plan.pieces:
            s = int(piece[SOURCE])
            if s in whole:
                record = planner.record_at(s, int(piece[POSITION]))
                assert piece[OFFSET] == 0
                assert piece[LENGTH] == min(int(lengths[s][record]), seq_len)  # whole, or truncated to seq_len
                seen += 1
        # rows never overflow, and every step holds at most its real-token capacity
        per_row = np.bincount(plan.rank * plan.rows_per_rank + plan.row, weights=plan.pieces[:, LENGTH])
        assert per_row.max() <= plan.row_capacity
        assert sum(plan.source_tokens) <= job.step_tokens
    assert seen > 100


def test_drop_skips_samples_longer_than_seq_len(dataset_dir):
    job = _whole_job(dataset_dir, long_docs="drop")
    planner, lengths, plans = _run(job)
    for plan in plans:
        for piece in plan.pieces:
            s = int(piece[SOURCE])
            if s in (0, 2):
                assert lengths[s][planner.record_at(s, int(piece[POSITION]))] <= job.batch.seq_len


def test_the_mixture_holds_in_real_tokens_and_concat_fills_the_room(dataset_dir):
    job = _whole_job(dataset_dir)
    planner, _, plans = _run(job, steps=60)
    tokens = np.sum([p.source_tokens for p in plans], axis=0)
    share = tokens / tokens.sum()
    np.testing.assert_allclose(share, [0.5, 0.3, 0.2], atol=0.03)
    # the concat source (code) fills rows: the steps hold nearly their capacity
    fill = np.mean([sum(p.source_tokens) / job.step_tokens for p in plans])
    assert fill > 0.97, fill


def test_whole_only_steps_are_deterministic_and_padding_stays_small(dataset_dir):
    job = _whole_job(dataset_dir, weights={"web": 0.6, "long": 0.4})
    _, _, a = _run(job, steps=30)
    _, _, b = _run(job, steps=30)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.pieces, y.pieces)
        np.testing.assert_array_equal(x.row, y.row)
    fill = np.mean([sum(p.source_tokens) / job.step_tokens for p in a])
    assert fill > 0.85, fill
    # every position is taken once: none is lost or repeated between steps
    positions = defaultdict(list)
    for p in a:
        for piece in p.pieces:
            positions[int(piece[SOURCE])].append(int(piece[POSITION]))
    for s, pos in positions.items():
        assert sorted(pos) == list(range(len(pos))) or len(set(pos)) == len(pos)


def test_samples_left_out_open_the_next_step_and_none_is_lost_or_repeated(dataset_dir):
    job = _whole_job(dataset_dir, weights={"web": 0.6, "long": 0.4})
    planner, lengths, plans = _run(job, steps=60)
    taken = defaultdict(list)
    for p in plans:
        for piece in p.pieces:
            taken[int(piece[SOURCE])].append(int(piece[POSITION]))
    for s, positions in taken.items():
        assert len(set(positions)) == len(positions)  # never twice
        # every position below the cursor was delivered, unless it is deferred or unusable (length 0)
        waiting = {u[0] for u in planner.state.deferred[s]}
        for pos in range(planner.state.cursors[s]):
            record = planner.record_at(s, pos)
            assert pos in positions or pos in waiting or lengths[s][record] == 0
        assert len(waiting) <= 8  # left-out samples go first: the list stays short


def test_a_planner_resumed_from_its_json_state_continues_the_same_stream(dataset_dir):
    from coordinator.plan import PlannerState

    job = _whole_job(dataset_dir, weights={"web": 0.6, "long": 0.4})
    planner, lengths, first = _run(job, steps=20)
    assert any(planner.state.deferred)  # the case this checks
    saved = PlannerState.from_json(planner.state.to_json())
    known = Known(planner, lengths)
    more = [planner.plan_step(known) for _ in range(10)]
    again = Planner(job, COUNTS)
    again.state = saved
    known2 = Known(again, lengths)
    for a in more:
        b = again.plan_step(known2)
        np.testing.assert_array_equal(a.pieces, b.pieces)
        np.testing.assert_array_equal(a.row, b.row)


def test_a_state_without_deferred_samples_reads_as_before():
    from coordinator.plan import PlannerState

    st = PlannerState(3, [1, 2], [None, None], [0.0, 1.0], [0, 1], [False, False])
    assert "deferred" not in st.to_json()
    assert PlannerState.from_json(st.to_json()).deferred == [[], []]


def test_the_coordinator_counts_long_samples_truncated_or_dropped(dataset_dir):
    """Through the coordinator's state: samples longer than seq_len are counted per source in the
    status (long_docs) as they are prepared."""
    from tests.unit.coordinator_driver import Driver

    job = _whole_job(dataset_dir)
    driver = Driver(job)
    driver.add_worker("w0")
    driver.add_rank(0)
    driver.add_rank(1)
    driver.run(6)
    assert not driver.unserved
    status = driver.state.status()
    assert status["long_docs"].get("web", {}).get("truncated", 0) + \
        status["long_docs"].get("long", {}).get("truncated", 0) > 0


def _conversation_tokens(rng) -> int:
    """Tokens of a chat sample like bench_packing's: 1 to 12 turns of messages of 5 to 40, 120 or
    400 words."""
    turns = int(rng.choice([1, 1, 2, 3, 6, 12]))
    words = int(rng.choice([40, 120, 400]))
    return int(sum(8 + 1.3 * rng.integers(5, words + 1) for _ in range(2 * turns)))


def test_exchanges_between_ranks_lower_the_busiest_rank_and_keep_every_row_within_its_length(monkeypatch):
    """Every row full, a rank holding a long conversation can only get cheaper by trading its
    other samples for shorter ones of another rank (one for one, or one for two): the same samples,
    hence the same padding, a lower busiest rank."""
    from coordinator import balance

    grid = balance.Grid(ranks=8, micro_batches=2, micro_batch_size=1, row_capacity=4096)
    cost = balance.Cost(1.0, 0.0)
    rng = np.random.default_rng(0)
    lowered, steps = 0, 40
    for _ in range(steps):
        lengths = np.minimum(4096, [_conversation_tokens(rng) for _ in range(200)])
        lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), 16 * 4096 * 1.05))]
        whole = np.ones(len(lengths), bool)
        budget = 16 * 4096
        with monkeypatch.context() as m:
            m.setattr(balance, "SWAP_ROUNDS_PER_RANK", 0)
            before, left_before = balance.whole_layout(lengths, whole, grid, cost, budget=budget)
        after, left_after = balance.whole_layout(lengths, whole, grid, cost, budget=budget)
        assert left_after.tolist() == left_before.tolist()
        assert sorted(after.piece.tolist()) == sorted(before.piece.tolist())
        assert (after.offset == 0).all() and (after.length == lengths[after.piece]).all()  # never cut
        assert np.bincount(after.row, weights=after.length, minlength=16).max() <= 4096
        worst_before = before.rank_costs(grid, cost).max()
        worst_after = after.rank_costs(grid, cost).max()
        assert worst_after <= worst_before
        lowered += worst_after < worst_before * (1 - 1e-9)
    assert lowered >= steps // 4, lowered


def _whole_step(rng, grid, images: bool):
    """One step's worth of conversation lengths (10 % over the rows, as the planner draws), with
    per-sample image costs where `images`, and a token budget of the rows."""
    rows = grid.ranks * grid.rows_per_rank
    lengths = np.minimum(grid.row_capacity, [_conversation_tokens(rng) for _ in range(rows * 12)])
    lengths = lengths[:int(np.searchsorted(np.cumsum(lengths), rows * grid.row_capacity * 1.1))]
    from coordinator import balance
    cost = balance.Cost(1.0, float(rng.choice([0.0, 300.0])))
    if images:  # some samples carry images: the encoder's cost, not in proportion to their tokens
        ratio = rng.uniform(0, 4, len(lengths)) * (rng.random(len(lengths)) < 0.4)
        cost = balance.Cost(1.0, cost.linear, ratio, 0.4, 20.0, ratio * ratio / rng.integers(1, 4, len(lengths)))
    return lengths, cost, rows * grid.row_capacity


def test_compiled_whole_layout_matches_the_python_reference(monkeypatch):
    """coordinator._whole (C) and balance._place_whole / _exchange_rounds run the same rule: the
    same samples in the same rows in the same order, and the same samples left out, on grids of 1
    to 64 ranks with micro-batches, token slack, linear and image costs, and samples left out
    before that go first."""
    from coordinator import balance

    assert balance._compiled_whole is not None, "coordinator._whole was not built (setup.py)"
    rng = np.random.default_rng(5)
    for trial in range(40):
        grid = balance.Grid(int(rng.choice([1, 2, 3, 8, 13, 64])), int(rng.integers(1, 4)), int(rng.integers(1, 3)),
                            int(rng.choice([1024, 2048, 4096, 5120])))
        lengths, cost, budget = _whole_step(rng, grid, images=trial % 2 == 1)
        first = rng.random(len(lengths)) < 0.05
        whole = rng.random(len(lengths)) < 0.9 if trial % 5 == 4 else np.ones(len(lengths), bool)
        layouts = []
        for compiled in (True, False):
            with monkeypatch.context() as m:
                if not compiled:
                    m.setattr(balance, "_compiled_whole", None)
                layouts.append(balance.whole_layout(lengths, whole, grid, cost, first, budget=budget))
        (lay_c, left_c), (lay_py, left_py) = layouts
        for a, b in zip(lay_c, lay_py):
            assert np.array_equal(a, b), trial
        assert np.array_equal(left_c, left_py), trial


@pytest.mark.parametrize("images", [False, True])
def test_at_64_ranks_the_busiest_rank_is_within_3_percent_of_the_bound(monkeypatch, images):
    """tools/bench_packing.py's conversations (rendered and tokenized; with images, the encoder's
    cost too) planned for 64 ranks x 2 rows of 4,096, every row full: the busiest rank of the
    median step is within 3 % of the lower bound no layout of the step's samples can beat
    (balance.busiest_rank_bound), padding under 1 %; without the exchanges it is further off."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    import bench_packing
    from coordinator import balance

    distinct = bench_packing.lengths_of_conversations(1500, seed=3)
    squares = patches = None
    if images:
        image_tokens, squares, patches = bench_packing.images_of_conversations(1500, seed=3)
        distinct = distinct + image_tokens
    drawn = np.random.default_rng(3).integers(0, 1500, 6000)
    if images:
        squares, patches = squares[drawn], patches[drawn]
    run = bench_packing.msd_packing(distinct[drawn], 4096, 64, 2, 0.0, squares, patches)
    assert run["steps"] >= 6
    assert run["max_over_full_rows_bound_median"] <= 1.03, run
    assert run["padding_share"] <= 0.01, run
    monkeypatch.setattr(balance, "SWAP_ROUNDS_PER_RANK", 0)
    placed_only = bench_packing.msd_packing(distinct[drawn], 4096, 64, 2, 0.0, squares, patches)
    assert placed_only["max_over_full_rows_bound_median"] > run["max_over_full_rows_bound_median"] + 0.01, \
        (placed_only, run)
