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
