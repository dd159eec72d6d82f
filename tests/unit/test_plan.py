"""The planner, driven with synthetic lengths (no sockets): the draw against a plain sequential
reference, quotas, curriculum stages, exhausted sources, packing, coverage, balance."""

from collections import defaultdict

import numpy as np
import pytest

from coordinator.balance import imbalance
from msd_common.spec import parse_job
from coordinator.plan import LENGTH, OFFSET, POSITION, RECORD, SOURCE, NeedLength, Planner, SourceExhausted
from tests.conftest import job_dict

SEQ_LEN = 512
COUNTS = [50, 70, 30]


def _lengths(num_records, seed=0):
    rng = np.random.default_rng(seed)
    # long-tailed: mostly short documents, some longer than seq_len
    return [(rng.pareto(1.2, n) * 120 + 8).astype(int) for n in num_records]


class Known:
    """Lengths of every position (or of those in `allowed`), as the coordinator would know them."""

    def __init__(self, planner, lengths, allowed=None):
        self.planner, self.lengths, self.allowed = planner, lengths, allowed

    def window(self, s, start, count):
        records = np.array([self.planner.record_at(s, p) for p in range(start, start + count)], dtype=np.int64)
        lengths = self.lengths[s][records].astype(np.int64)
        if self.allowed is not None:
            lengths = np.where([(s, p) in self.allowed for p in range(start, start + count)], lengths, -1)
        return records, lengths


def _job(dataset_dir, **overrides):
    return parse_job(job_dict(**overrides), "job.yaml", base_dir=dataset_dir)


def _planner(dataset_dir, counts=COUNTS, **overrides):
    job = _job(dataset_dir, **overrides)
    return job, Planner(job, counts), _lengths(counts)


def _plan(planner, lengths, steps):
    known = Known(planner, lengths)
    return [planner.plan_step(known) for _ in range(steps)]


def _reference_draw(job, counts, lengths, steps):
    """The draw written plainly, one piece at a time: the source furthest behind its target gives
    the next piece (lowest index on ties); documents cut at seq_len and at the end of a step."""
    planner = Planner(job, counts)  # only for record_at
    n = len(counts)
    target, delivered, cursor = [0.0] * n, [0] * n, [0] * n
    carry = [None] * n
    out = []
    for step in range(steps):
        weights = job.weights_at(step)
        cap, seq_len = job.step_tokens_at(step), job.seq_len_at(step)
        for s in range(n):
            target[s] += weights[s] * cap
        filled, drawn = 0, []
        while filled < cap:
            s = max((s for s in range(n) if weights[s] > 0), key=lambda s: (target[s] - delivered[s], -s))
            if carry[s] is None:
                while True:
                    rec = planner.record_at(s, cursor[s])
                    cursor[s] += 1
                    if lengths[s][rec] > 0:
                        end = int(lengths[s][rec])
                        if job.sources[s].long_docs == "truncate":
                            end = min(end, seq_len)
                        carry[s] = (cursor[s] - 1, rec, 0, end)
                        break
            pos, rec, off, end = carry[s]
            take = min(end - off, seq_len, cap - filled)
            drawn.append((s, pos, rec, off, take))
            filled += take
            delivered[s] += take
            carry[s] = (pos, rec, off + take, end) if off + take < end else None
        out.append(sorted(drawn))
    return out


def _ranges(pieces):
    """(source, position, record) -> (first offset, tokens) of each document in a step, checking
    that its pieces tile one contiguous range."""
    by_doc = defaultdict(list)
    for s, pos, rec, off, n in pieces:
        by_doc[(s, pos, rec)].append((off, n))
    out = {}
    for doc, parts in by_doc.items():
        parts.sort()
        for (o1, n1), (o2, _) in zip(parts, parts[1:]):
            assert o1 + n1 == o2, (doc, parts)
        out[doc] = (parts[0][0], sum(n for _, n in parts))
    return out


@pytest.mark.parametrize("overrides", [
    {},
    {"mixture": [{"until_step": 7, "weights": {"web": 0.7, "code": 0.3}},
                 {"until_step": 20, "weights": {"web": 0.2, "code": 0.3, "long": 0.5}, "ramp_steps": 5},
                 {"weights": {"web": 0.4, "long": 0.6}, "seq_len": 1024}]},
    {"long_docs": "truncate"},
])
def test_vectorised_draw_equals_the_sequential_reference(dataset_dir, overrides):
    job, planner, lengths = _planner(dataset_dir, **overrides)
    plans = _plan(planner, lengths, 40)
    reference = _reference_draw(job, COUNTS, lengths, 40)
    for plan, ref in zip(plans, reference):
        assert _ranges(plan.pieces.tolist()) == _ranges(ref), plan.step


def test_every_step_is_full_and_rows_hold_at_most_their_capacity(dataset_dir):
    job, planner, lengths = _planner(dataset_dir)
    for plan in _plan(planner, lengths, 100):
        t = plan.pieces
        assert int(t[:, LENGTH].sum()) == job.step_tokens
        assert (t[:, LENGTH] > 0).all() and (t[:, LENGTH] <= SEQ_LEN).all()
        rows = plan.rank * plan.rows_per_rank + plan.row
        per_row = np.bincount(rows, weights=t[:, LENGTH], minlength=job.dp * plan.rows_per_rank)
        assert (per_row == SEQ_LEN).all()  # no slack: every sequence exactly full
        assert (plan.micro_batch == plan.row // job.batch.micro_batch_size).all()
        assert (np.diff(rows) >= 0).all()  # delivery order: rank, then row


def test_quota_error_diffusion_stays_within_one_piece(dataset_dir):
    job, planner, lengths = _planner(dataset_dir)
    weights = [job.weights[s.name] for s in job.sources]
    delivered = np.zeros(3)
    for k, plan in enumerate(_plan(planner, lengths, 300), start=1):
        delivered += np.bincount(plan.pieces[:, SOURCE], weights=plan.pieces[:, LENGTH], minlength=3)
        for s, w in enumerate(weights):
            assert abs(delivered[s] - w * k * job.step_tokens) <= SEQ_LEN, (k, s, delivered)


def test_curriculum_stages_ramp_and_change_seq_len(dataset_dir):
    stages = [{"until_step": 10, "weights": {"web": 1.0}},
              {"until_step": 30, "weights": {"code": 1.0}, "ramp_steps": 10},
              {"weights": {"long": 1.0}, "seq_len": 1024}]
    job, planner, lengths = _planner(dataset_dir, mixture=stages)
    plans = _plan(planner, lengths, 40)
    share = [np.bincount(p.pieces[:, SOURCE], weights=p.pieces[:, LENGTH], minlength=3) / p.pieces[:, LENGTH].sum()
             for p in plans]
    assert all(share[k][0] == 1.0 for k in range(10))
    # the ramp: code's share follows the linear target over steps 10..19 (within a piece each side)
    for k in range(10, 20):
        assert abs(share[k][1] - (k - 9) / 10) <= 2 * SEQ_LEN / job.step_tokens, (k, share[k])
    assert all(share[k][1] > 0.9 for k in range(21, 30))
    assert all(p.row_capacity == 1024 and p.pieces[:, LENGTH].sum() == 8 * 1024 for p in plans[30:])
    assert all(share[k][2] > 0.85 for k in range(32, 40))
    assert all(p.pieces[:, LENGTH].max() <= 512 for p in plans[:30])


def test_cumulative_tokens_follow_the_curriculum_targets(dataset_dir):
    stages = [{"until_step": 50, "weights": {"web": 0.7, "code": 0.3}},
              {"weights": {"web": 0.2, "code": 0.3, "long": 0.5}, "ramp_steps": 40}]
    job, planner, lengths = _planner(dataset_dir, mixture=stages)
    target, delivered = np.zeros(3), np.zeros(3)
    for plan in _plan(planner, lengths, 200):
        target += np.array(job.weights_at(plan.step)) * job.step_tokens
        delivered += np.bincount(plan.pieces[:, SOURCE], weights=plan.pieces[:, LENGTH], minlength=3)
        assert (np.abs(delivered - target) <= SEQ_LEN).all(), (plan.step, delivered, target)


def test_documents_are_covered_in_order_without_gaps_or_repeats(dataset_dir):
    job, planner, lengths = _planner(dataset_dir)
    covered = defaultdict(list)  # (source, position) -> [(offset, length)]
    finished = set()
    for plan in _plan(planner, lengths, 200):
        for s, pos, rec, off, n in plan.pieces.tolist():
            covered[(s, pos)].append((off, n))
        finished |= set(map(tuple, plan.finished.tolist()))
    for (s, pos), ranges in covered.items():
        ranges.sort()
        at = 0
        for off, n in ranges:
            assert off == at, (s, pos, ranges)
            at += n
        full = int(lengths[s][planner.record_at(s, pos)])
        if (s, pos) in finished:
            assert at == full
        else:
            assert at < full  # only a document cut by the last step may be incomplete


def test_planning_changes_nothing_on_need_length_and_resumes_identically(dataset_dir):
    job, p1, lengths = _planner(dataset_dir)
    a = [plan.pieces.tolist() for plan in _plan(p1, lengths, 30)]

    _, p2, _ = _planner(dataset_dir)
    allowed = set()
    known = Known(p2, lengths, allowed)
    b, misses = [], 0
    while len(b) < 30:  # lengths arrive a few records at a time, as if from slow workers
        try:
            b.append(p2.plan_step(known).pieces.tolist())
        except NeedLength as need:
            misses += 1
            allowed.update((need.source, need.position + i) for i in range(3))
    assert a == b
    assert misses > 10


def test_balance_beats_arrival_order_on_attention_cost(dataset_dir):
    job, planner, lengths = _planner(dataset_dir)
    plans = _plan(planner, lengths, 100)
    ours = np.mean([imbalance(p.rank_costs) for p in plans])
    naive = np.mean([imbalance(p.naive_rank_costs) for p in plans])
    assert ours < naive
    assert ours < 1.15


def test_zero_length_records_are_skipped(dataset_dir):
    job, planner, lengths = _planner(dataset_dir)
    lengths[0][:] = 0
    lengths[0][3] = 40  # only one usable web record
    for plan in _plan(planner, lengths, 5):
        web = plan.pieces[plan.pieces[:, SOURCE] == 0]
        assert (web[:, RECORD] == 3).all()


def test_truncate_keeps_only_the_head_of_long_documents(dataset_dir):
    job, planner, lengths = _planner(dataset_dir, long_docs="truncate")
    for plan in _plan(planner, lengths, 50):
        assert (plan.pieces[:, OFFSET] + plan.pieces[:, LENGTH] <= SEQ_LEN).all()


def test_finite_epochs_renormalise_and_log(dataset_dir):
    job_raw = job_dict()
    job_raw["sources"]["long"]["epochs"] = 1
    job = parse_job(job_raw, "job.yaml", base_dir=dataset_dir)
    planner = Planner(job, COUNTS)
    lengths = _lengths(COUNTS)
    plans = _plan(planner, lengths, 120)
    long_positions = [pos for p in plans for pos in p.pieces[p.pieces[:, SOURCE] == 2][:, POSITION].tolist()]
    assert set(long_positions) == set(range(COUNTS[2]))  # one pass over all 30 records, no more
    assert planner.state.exhausted == [False, False, True]
    assert any("exhausted" in e for e in planner.events)
    after = plans[-1].pieces
    assert set(after[:, SOURCE].tolist()) <= {0, 1}
    web, code = (after[after[:, SOURCE] == s][:, LENGTH].sum() for s in (0, 1))
    assert abs(web / (web + code) - 0.5 / 0.8) < 0.2


def test_on_exhausted_stop_ends_the_stream(dataset_dir):
    job_raw = job_dict()
    job_raw["sources"]["long"].update(epochs=1, on_exhausted="stop")
    job = parse_job(job_raw, "job.yaml", base_dir=dataset_dir)
    planner = Planner(job, COUNTS)
    known = Known(planner, _lengths(COUNTS))
    with pytest.raises(SourceExhausted) as e:
        for _ in range(1000):
            planner.plan_step(known)
    assert e.value.source == "long" and e.value.step == planner.state.next_step
    with pytest.raises(SourceExhausted):  # and it stays ended
        planner.plan_step(known)


def test_run_time_weights_apply_from_their_step_only(dataset_dir):
    job, planner, lengths = _planner(dataset_dir)
    _plan(planner, lengths, 5)
    with pytest.raises(ValueError, match="already planned"):
        planner.set_weights(3, [1, 0, 0])
    planner.set_weights(8, [0, 0, 1])
    plans = _plan(planner, lengths, 10)
    assert set(plans[2].pieces[:, SOURCE].tolist()) != {2}
    assert all(set(p.pieces[:, SOURCE].tolist()) == {2} for p in plans[4:])


@pytest.mark.parametrize("method", ["greedy", "karmarkar_karp", "none"])
@pytest.mark.parametrize("slack", [0.0, 0.5])
def test_every_method_lays_out_the_whole_step(dataset_dir, method, slack):
    job, planner, lengths = _planner(dataset_dir, balance={"method": method, "token_slack": slack})
    width = int(SEQ_LEN * (1 + slack))
    for plan in _plan(planner, lengths, 30):
        t = plan.pieces
        assert plan.row_capacity == width
        assert int(t[:, LENGTH].sum()) == job.step_tokens
        rows = plan.rank * plan.rows_per_rank + plan.row
        assert np.bincount(rows, weights=t[:, LENGTH]).max() <= width
        assert (np.diff(rows) >= 0).all()


@pytest.mark.parametrize("overrides", [{}, {"long_docs": "truncate"}])
def test_candidates_of_all_sources_at_once_equal_those_of_each_source(dataset_dir, overrides):
    """The batched first window (_candidates_all) gives each source exactly what _candidates
    gives it: with carried documents, lengths not known yet and budgets beyond a first window."""
    job, planner, lengths = _planner(dataset_dir, **overrides)
    rng = np.random.default_rng(5)
    allowed = {(s, p) for s in range(len(COUNTS)) for p in range(400)}
    known = Known(planner, lengths)
    compared = 0
    for step in range(25):
        partial = Known(planner, lengths, {k for k in allowed if rng.random() < 0.97})
        for budget_scale in (0.1, 1.0, 6.0):
            budget = {s: budget_scale * job.step_tokens_at(step) * (s + 1) / 3 + SEQ_LEN for s in range(len(COUNTS))}
            for k in (known, partial):
                batched = planner._candidates_all(list(range(len(COUNTS))), budget, SEQ_LEN, k)
                for s in range(len(COUNTS)):
                    one = planner._candidates(s, budget[s], SEQ_LEN, k)
                    got = batched[s]
                    assert np.array_equal(got.table, one.table) and np.array_equal(got.ends, one.ends)
                    assert (got.missing, got.exhausted) == (one.missing, one.exhausted)
                    compared += 1
        planner.plan_step(known)
    assert compared == 25 * 3 * 2 * len(COUNTS)
