"""coordinator/calibrate.py: the robust fit of the cost model and when a fit is proposed."""

import numpy as np

from coordinator.calibrate import MIN_SAMPLES, Calibrator, fit, scaled_error


def _samples(n=400, seed=0, truth=(2e-9, 5e-6, 1e-3), outliers=0):
    rng = np.random.default_rng(seed)
    lengths = rng.pareto(1.2, (n, 6)) * 300 + 20
    x = np.column_stack([(lengths ** 2).sum(1), lengths.sum(1), np.ones(n), np.zeros(n), np.zeros(n)])
    y = x[:, :3] @ np.asarray(truth) * (1 + 0.01 * rng.standard_normal(n))
    y[:outliers] *= 8  # a noisy host's slow micro-batches
    return x, y


def test_the_fit_finds_the_truths_shape_despite_outliers():
    x, y = _samples(outliers=20)
    f = fit(x, y)
    q, lin, const, pq, pl = f.coefficients
    assert abs((q / lin) / (2e-9 / 5e-6) - 1) < 0.1
    assert pq == pl == 0.0 and min(q, lin, const) >= 0
    assert f.error < 0.05


def test_a_fit_is_proposed_only_when_clearly_better_than_the_model():
    x, y = _samples(truth=(2e-9, 5e-6, 0.0))
    right = Calibrator((2e-9, 5e-6, 0.0, 0.0, 0.0))  # the truth's shape, at another scale below
    right.current = (4e-9, 1e-5, 0.0, 0.0, 0.0)
    wrong = Calibrator((1.0, 0.0, 0.0, 0.0, 0.0))  # attention only
    for c in (right, wrong):
        c.add(x[:MIN_SAMPLES - 1], y[:MIN_SAMPLES - 1])
        assert c.propose() is None  # too few samples yet
        c.add(x[MIN_SAMPLES:], y[MIN_SAMPLES:])
    assert wrong.propose() is not None
    assert right.propose() is None
    assert scaled_error(x, y, (1.0, 0.0, 0, 0, 0)) > 5 * scaled_error(x, y, (2e-9, 5e-6, 0, 0, 0))


def test_the_fit_finds_a_patch_cost_the_model_left_out():
    """Image-text micro-batches: a vision encoder's attention over each image's patches is a cost of
    its own (patches^2), which a text-only model cannot express; the fit finds it beside the
    text's linear cost, and a model without it is clearly worse."""
    rng = np.random.default_rng(3)
    n = 400
    text = rng.integers(20, 400, (n, 6)).astype(float)
    patches = rng.integers(0, 256, (n, 6)).astype(float) * (rng.random((n, 6)) < 0.5)
    lengths = text + patches  # a piece's tokens hold its image's placeholders
    x = np.column_stack([(lengths ** 2).sum(1), lengths.sum(1), np.ones(n), (patches ** 2).sum(1), patches.sum(1)])
    truth = np.array([0.0, 1e-5, 0.0, 2e-7, 0.0])
    y = x @ truth * (1 + 0.01 * rng.standard_normal(n))
    f = fit(x, y)
    q, lin, _, pq, _ = f.coefficients
    assert abs(pq / truth[3] - 1) < 0.1 and abs(lin / truth[1] - 1) < 0.1 and q < 0.05 * 1e-5 / 1000
    assert f.error < 0.02
    assert scaled_error(x, y, (0.0, 1.0, 0.0, 0.0, 0.0)) > 5 * f.error
