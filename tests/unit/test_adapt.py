"""mixture.adapt (coordinator/adapt.py) and DataClient.report_loss's sums (trainer_client/losses.py):
the policies move weight as they promise within their limits; a decision taken after step k
applies from step k + lookahead + 2, journaled as a mixture change; the plan waits for a decision
rather than planning past it; the same losses give the same trajectory, and a restart replays it
from the journal without deciding again; a policy that fails keeps the weights and is named."""

from __future__ import annotations

import math

import numpy as np
import pytest

from coordinator.adapt import History, constrain, loss_share, odm
from coordinator.adapt import ado as ado_policy
from msd_common.doc_keys import doc_key
from msd_common.spec import AdaptConfig, ConfigError, parse_job
from tests.conftest import job_dict
from trainer_client.losses import LossSums

from .coordinator_driver import Driver

LOOKAHEAD = 3
LOSS = {0: 3.0, 1: 1.0, 2: 1.0}  # web is learnt least


def _job(dataset_dir, **adapt):
    mixture = {"weights": {"web": 0.2, "code": 0.4, "long": 0.4}}
    if adapt:
        mixture["adapt"] = adapt
    return parse_job(job_dict(mixture=mixture, runtime={"heartbeat_s": 0.5, "prepare_batch": 16,
                                                        "lookahead_steps": LOOKAHEAD}),
                     "job.yaml", base_dir=dataset_dir)


def _run(job, steps: int, loss_of=LOSS.get) -> Driver:
    d = Driver(job)
    d.loss_of = loss_of
    d.add_worker("w0")
    d.add_rank(0)
    d.add_rank(1)
    d.run(steps)
    return d


def test_loss_share_moves_weight_to_the_source_learnt_least_from_the_step_the_delay_gives(dataset_dir):
    job = _job(dataset_dir, policy="loss_share", every_steps=4, max_step_change=0.1)
    d = _run(job, 16)
    changes = d.state.mixture_changes
    assert [at for at, _ in changes][:3] == [3 + LOOKAHEAD + 2, 7 + LOOKAHEAD + 2, 11 + LOOKAHEAD + 2]
    web = [w[0] for _, w in changes]
    assert web[0] == pytest.approx(0.3) and web[1] == pytest.approx(0.4)  # +0.1 a decision at most
    assert all(abs(sum(w) - 1) < 1e-9 for _, w in changes)
    status = d.state.adapt.status()
    assert status["policy"] == "loss_share" and status["last_loss"]["web"] == pytest.approx(3.0)
    # the plan used the new weights from their step on
    assert d.state.planner.weights_at(changes[0][0])[0] == pytest.approx(web[0])
    assert d.state.planner.weights_at(changes[0][0] - 1)[0] == pytest.approx(0.2)


def test_the_same_losses_give_the_same_trajectory_and_stream(dataset_dir):
    job = _job(dataset_dir, policy="odm", every_steps=3, warmup_steps=6)
    a, b = _run(job, 15), _run(job, 15)
    assert a.state.mixture_changes == b.state.mixture_changes and a.state.mixture_changes
    assert a.state.mixture_changes[0][0] == 5 + LOOKAHEAD + 2  # the first decision after warmup
    assert a.stream(15) == b.stream(15)
    plain = _run(_job(dataset_dir), 15)
    assert plain.state.mixture_changes == [] and plain.stream(15) != a.stream(15)


def test_no_loss_reported_keeps_the_weights(dataset_dir):
    d = _run(_job(dataset_dir, policy="loss_share", every_steps=2), 12, loss_of=None)
    assert d.state.mixture_changes == []
    assert d.state.adapt.status()["last_loss"] == {"web": None, "code": None, "long": None}


def test_the_plan_never_outruns_a_pending_decision(dataset_dir):
    """Ranks that stop consuming leave the decision untaken: no step from its apply step is planned
    (the look-ahead bound stops the plan first; the book's gate holds as well)."""
    job = _job(dataset_dir, policy="loss_share", every_steps=2)
    d = Driver(job)
    d.loss_of = LOSS.get
    d.add_worker("w0")
    d.add_rank(0)
    d.add_rank(1)
    d.run(1)  # both ranks consumed step 0; the decision after step 1 needs step 2 consumed
    d.hold_consumed = True
    for _ in range(200):
        d.flush() if d.pending else d.tick()
    apply = 1 + LOOKAHEAD + 2  # of the decision after step 1, which needs step 2 consumed
    assert d.state.planner.state.next_step <= apply and d.state.mixture_changes == []
    assert d.state.adapt.holds(apply) and not d.state.adapt.holds(apply - 1)


def test_a_restart_replays_the_journaled_decisions_and_does_not_take_them_again(dataset_dir):
    from coordinator.adapt import AdaptBook

    job = _job(dataset_dir, policy="loss_share", every_steps=2)
    d = _run(job, 10)
    journaled = [at for at, _ in d.state.mixture_changes]
    book = AdaptBook(job.adapt, ["web", "code", "long"], LOOKAHEAD, lambda r: r, journaled, 7)
    decided = book.decide(9, lambda step: [1 / 3] * 3)
    assert all(x.at_step not in journaled for x in decided)
    assert all(x.at_step >= 7 for x in decided)


def test_a_failing_user_policy_keeps_the_weights_and_is_named(dataset_dir, monkeypatch):
    import coordinator.adapt as adapt

    def broken(step, history):
        return {"web": -1.0, "code": 1.0, "long": 1.0}

    monkeypatch.setitem(adapt.BUILT_IN, "loss_share", broken)
    d = _run(_job(dataset_dir, policy="loss_share", every_steps=2), 8)
    assert d.state.mixture_changes == []
    assert "finite and >= 0" in d.state.adapt.status()["failed"]


def test_the_adapt_keys_are_checked(dataset_dir):
    for adapt, why in (({"policy": "bandit", "every_steps": 2}, "mixture.adapt.policy"),
                       ({"policy": "odm"}, "mixture.adapt.every_steps"),
                       ({"policy": "odm", "every_steps": 2, "sources": ["web"]}, "mixture.adapt.sources"),
                       ({"policy": "odm", "every_steps": 2, "min_weight": 0.5}, "mixture.adapt.min_weight"),
                       ({"policy": "no.such.module:fn", "every_steps": 2}, "mixture.adapt.policy"),
                       ({"policy": "odm", "every_steps": 2, "max_step_change": 0}, "mixture.adapt.max_step_change")):
        with pytest.raises(ConfigError) as e:
            _job(dataset_dir, **adapt)
        assert any(p.startswith(why) for p in e.value.problems), (adapt, e.value.problems)
    plain, adapted = _job(dataset_dir), _job(dataset_dir, policy="odm", every_steps=2)
    assert plain.digest() != adapted.digest() and plain.adapt is None
    assert adapted.adapt == AdaptConfig("odm", 2)


def test_policies_within_their_limits():
    h = History(steps=[1], loss={"a": [2.0], "b": [1.0]}, tokens={"a": [10], "b": [10]}, weights={"a": 0.5, "b": 0.5})
    assert loss_share(1, h) == pytest.approx({"a": 2 / 3, "b": 1 / 3})
    assert odm(1, h) == pytest.approx({"a": 0.5, "b": 0.5})  # the first window: all exploration (eps = 1/K)
    later = History(steps=list(range(10)), loss={"a": [2.0] * 10, "b": [1.0] * 10}, tokens={"a": [10] * 10,
                    "b": [10] * 10}, weights={"a": 0.5, "b": 0.5})
    o = odm(10, later)
    assert o["a"] > o["b"] > 0 and sum(o.values()) == pytest.approx(1)
    config = AdaptConfig("odm", 1, min_weight=0.1, max_step_change=0.05)
    assert constrain({"a": 1.0, "b": 0.0}, {"a": 0.5, "b": 0.5}, config) == pytest.approx({"a": 0.55, "b": 0.45})
    assert constrain({"a": 1.0, "b": 0.0}, {"a": 0.2, "b": 0.8}, AdaptConfig("odm", 1, min_weight=0.1)) == \
        pytest.approx({"a": 0.9, "b": 0.1})
    with pytest.raises(ValueError):
        constrain({"a": math.nan, "b": 1.0}, {"a": 0.5, "b": 0.5}, config)
    # ado: a source whose loss still falls fast is preferred over one that has flattened
    n = [100, 100, 100, 100]
    steep = [4.0 * (i * 100) ** -0.5 for i in range(1, 5)]
    flat = [1.0 * (i * 100) ** -0.01 for i in range(1, 5)]
    h = History(steps=[1, 2, 3, 4], loss={"a": steep, "b": flat}, tokens={"a": n, "b": n},
                weights={"a": 0.5, "b": 0.5})
    w = ado_policy(4, h)
    # the preferences b * L(n) of the power laws the losses follow, as weights (constrain then
    # limits how far one decision moves them)
    pa, pb = 0.5 * steep[-1], 0.01 * flat[-1]
    assert w == pytest.approx({"a": pa / (pa + pb), "b": pb / (pa + pb)})


def _batch():
    """Two rows: row 0 holds a web piece (5 tokens) then a code piece (3); row 1 one long piece (6)."""
    keys = np.array([doc_key(0, 7), doc_key(1, 2), doc_key(2, 9)], np.uint64).astype(np.int64)
    mask = np.zeros((2, 8), np.uint8)
    mask[0, :4] = 1  # web: 4 trained tokens
    mask[0, 5:7] = 1  # code: 2
    mask[1, :5] = 1  # long: 5
    return {"doc_keys": keys, "pieces_per_row": np.array([2, 1]), "piece_lengths": np.array([5, 3, 6]),
            "loss_mask": mask}


def test_report_loss_sums_per_source_over_the_trained_tokens():
    sums = LossSums()
    sums.handed(4, _batch())
    loss = np.arange(16, dtype=np.float32).reshape(2, 8)
    sums.add(loss)
    sums.add(np.array([1.0, 2.0, 3.0]))  # one mean per sample, weighted by its trained tokens
    step, sources, totals, tokens = sums.report(4)
    assert (step, sources, tokens) == (4, [0, 1, 2], [8, 4, 10])
    assert totals == pytest.approx([0 + 1 + 2 + 3 + 4 * 1.0, 5 + 6 + 2 * 2.0, 8 + 9 + 10 + 11 + 12 + 5 * 3.0])
    assert sums.report(4) == [-1, [], [], []]  # sent once
    with pytest.raises(ValueError, match="per token"):
        sums.add(np.zeros((3, 3)))


def test_report_loss_takes_torch_tensors_as_the_client_hands_them():
    torch = pytest.importorskip("torch")
    numpy_sums, torch_sums = LossSums(), LossSums()
    numpy_sums.handed(2, _batch())
    torch_sums.handed(2, {k: torch.from_numpy(np.asarray(v)) for k, v in _batch().items()})
    loss = np.linspace(0, 1, 16, dtype=np.float32).reshape(2, 8)
    numpy_sums.add(loss)
    torch_sums.add(torch.from_numpy(loss).requires_grad_())  # detached, as a trainer's loss would be
    assert torch_sums.report(2) == numpy_sums.report(2)


def test_report_loss_names_a_micro_batch_taken_before_the_last():
    """A trainer that takes a step's micro-batches before computing them (the Hugging Face
    Trainer's gradient accumulation) names each one: its sums are those of reporting it at once."""
    at_once, later = LossSums(), LossSums()
    loss = np.arange(16, dtype=np.float32).reshape(2, 8)
    at_once.handed(4, _batch(), 0)
    at_once.add(loss)
    at_once.handed(4, _batch(), 1)
    at_once.add(loss * 2)
    later.handed(4, _batch(), 0)
    later.handed(4, _batch(), 1)
    later.add(loss * 2, at=(4, 1))
    later.add(loss, at=(4, 0))
    assert later.report(4) == at_once.report(4)
    later.handed(6, _batch(), 0)  # layouts of steps before the one before are let go
    with pytest.raises(ValueError, match="micro-batch 0 of step 4"):
        later.add(loss, at=(4, 0))


def _book(dp_of=lambda r: r // 2):
    from coordinator.adapt import AdaptBook

    return AdaptBook(AdaptConfig("loss_share", 2), ["web", "code"], 2, dp_of, [], 0)


def _reports(step: int) -> list[tuple[int, list[int], list[float], list[int]]]:
    """(rank, sources, loss sums, tokens) of 4 ranks, 2 per data-parallel rank (tp 2): peers alike."""
    return [(r, [0, 1], [0.1 * (step + 1) + 1e-9 * (r // 2), 3.3 + step / 7], [10 + r // 2, 20]) for r in range(4)]


@pytest.mark.parametrize("tp", [2, 1])
def test_relay_tables_count_as_the_ranks_own_reports_in_any_order(tp):
    """A relay's table of its ranks' losses counts as their own reports: one per data-parallel
    rank, and summed exactly, so that neither the way they came nor their order changes a bit."""
    from msd_common.protocol import RELAY_LOSS

    direct, tables, backwards = (_book(lambda r: r // tp) for _ in range(3))
    for step in range(6):
        reports = _reports(step)
        for r, sources, sums, tokens in reports:
            direct.report(r, step, sources, sums, tokens)
        for r, sources, sums, tokens in reversed(reports):
            backwards.report(r, step, sources, sums, tokens)
        rows = [(r, step, s, n) for r, sources, sums, tokens in reports for s, n in zip(sources, tokens)]
        table = np.array(rows, np.int64).reshape(-1, len(RELAY_LOSS))
        tables.report_table(table[::-1], np.array([x for _, _, sums, _ in reports for x in sums])[::-1])
        weights = lambda at: [0.5, 0.5]  # noqa: E731
        for book in (direct, tables, backwards):
            book.decide(step, weights)
            assert len(book.reports) <= 1 and sum(len(t) for t, _ in book.tables) <= 8  # the steps in flight only
    assert direct.history.steps == [1, 3]
    assert tables.history == direct.history == backwards.history
    if tp == 2:  # tensor-parallel peers count once
        mean = math.fsum(0.1 * (s + 1) * 2 + 1e-9 for s in range(2, 4)) / (2 * 21)
        assert direct.history.loss["web"][1] == pytest.approx(mean)
        assert direct.history.tokens["web"][1] == 2 * 21


def test_report_loss_keeps_63_bit_doc_keys_and_leaves_out_a_nan_loss():
    """Doc keys are read as integers (a float32 would round a record's bits into the source's),
    and a micro-batch whose loss is NaN is left out of the report instead of stopping the job."""
    torch = pytest.importorskip("torch")
    batch = {k: torch.from_numpy(np.asarray(v)) for k, v in _batch().items()}
    batch["doc_keys"] = torch.tensor([doc_key(0, (1 << 48) - 1), doc_key(1, 2), doc_key(2, 9)], dtype=torch.int64)
    sums = LossSums()
    sums.handed(3, batch, 0)
    sums.add(torch.ones(2, 8))
    sums.handed(3, batch, 1)
    sums.add(torch.full((2, 8), float("nan")))
    assert sums.report(3) == [3, [0, 1, 2], [4.0, 2.0, 5.0], [4, 2, 5]]


def test_a_devices_loss_is_summed_where_it_lies_as_the_hosts_is():
    """The path of a loss on a GPU (summed there, read a step later), run here on the CPU: the
    same sums as the host's numpy path."""
    torch = pytest.importorskip("torch")
    from trainer_client.losses import _layout, _piece_sums_numpy, _piece_sums_torch

    layout = _layout(_batch())
    loss = np.linspace(0, 3, 16).reshape(2, 8)
    on_device = _piece_sums_torch(torch.from_numpy(loss).to(torch.bfloat16).float(), layout)
    assert isinstance(on_device, torch.Tensor)  # not read yet
    np.testing.assert_allclose(on_device.tolist(), _piece_sums_numpy(torch.from_numpy(loss).to(torch.bfloat16)
                                                                      .double().numpy(), layout), rtol=1e-12)
