"""Fitting the cost model to the trainers' measured compute times (`balance.calibrate: true`).

Every rank reports, with each step's consumed message, the seconds each of its micro-batches
took (its client times from handing a micro-batch over to the next `next()`, or the trainer
says with `report_compute_seconds`). The coordinator knows what each micro-batch held (the
plan), so each report is a sample (features, seconds): features are the sums over the
micro-batch's pieces of len^2 and len, a 1 (a constant per micro-batch), and for image-text
pieces patches^2 and patches. `fit` solves for non-negative coefficients robustly: least squares
re-weighted with Huber weights (a few slow micro-batches from a noisy host move it little).
`Calibrator` keeps a window of recent samples and proposes a new model only when the fit's error
is smaller than the current model's (best scaled to the same samples) by `MARGIN`: a model that
changes the plan must be clearly better, since every change is journaled and starts a new
stretch of the stream.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TERMS = ("quadratic", "linear", "constant", "patch_quadratic", "patch_linear")
MIN_SAMPLES = 64  # micro-batches before a first fit, and between two fits
WINDOW = 2048  # most recent samples kept
MARGIN = 0.2  # a fit is adopted only if its error is at most (1 - MARGIN) x the current model's,
ABS_MARGIN = 0.02  # and smaller by this much (relative error): noise alone never changes the plan
EVIDENCE = 128  # samples journaled with each change (measured, predicted before and after)
HUBER_K = 1.345  # in units of the residuals' robust scale (MAD)


@dataclass(frozen=True)
class Fit:
    coefficients: tuple[float, ...]  # per TERMS, seconds per unit
    error: float  # robust relative error of the fit (median |residual| / median time)
    samples: int


def fit(features: np.ndarray, seconds: np.ndarray, iterations: int = 20) -> Fit:
    """Non-negative coefficients c minimising a Huber loss of features @ c - seconds. Columns
    that are all zero (no image pieces) get 0."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    used = np.flatnonzero(np.abs(x).sum(axis=0) > 0)
    scale = np.maximum(np.abs(x[:, used]).max(axis=0), 1e-300)  # columns of very different magnitudes
    xs = x[:, used] / scale
    w = np.ones(len(y))
    coef = np.zeros(len(used))
    for _ in range(iterations):
        coef = _nnls(xs * np.sqrt(w)[:, None], y * np.sqrt(w))
        r = xs @ coef - y
        s = 1.4826 * np.median(np.abs(r - np.median(r))) or 1e-12
        a = np.abs(r) / (HUBER_K * s)
        w = np.where(a <= 1, 1.0, 1.0 / np.maximum(a, 1e-12))
    out = np.zeros(x.shape[1])
    out[used] = coef / scale
    return Fit(tuple(float(v) for v in out), relative_error(x @ out, y), len(y))


def relative_error(predicted: np.ndarray, seconds: np.ndarray) -> float:
    return float(np.median(np.abs(predicted - seconds)) / max(float(np.median(seconds)), 1e-12))


def scaled_prediction(features: np.ndarray, seconds: np.ndarray, coefficients: tuple[float, ...]) -> np.ndarray:
    """A model's predicted seconds, at the scale that fits the times best."""
    cost = (np.asarray(features, dtype=np.float64) @ np.asarray(coefficients, dtype=np.float64))[:, None]
    return cost @ _nnls(cost, np.asarray(seconds, dtype=np.float64))


def scaled_error(features: np.ndarray, seconds: np.ndarray, coefficients: tuple[float, ...]) -> float:
    """The error of a model up to its scale: the current model's, as fairly as its shape allows
    (a scale error alone does not change a plan). No constant is granted: with micro-batches of
    nearly equal tokens, a constant would hide a linear cost the model lacks, which does change
    how the planner trades tokens against attention across ranks."""
    cost = (np.asarray(features, dtype=np.float64) @ np.asarray(coefficients, dtype=np.float64))[:, None]
    coef = _nnls(cost, np.asarray(seconds, dtype=np.float64))
    return relative_error(cost @ coef, seconds)


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares by projected coordinate descent (few columns)."""
    ata, atb = a.T @ a, a.T @ b
    x = np.clip(np.linalg.lstsq(a, b, rcond=None)[0], 0, None)
    for _ in range(200):
        before = x.copy()
        for j in range(len(x)):
            if ata[j, j] <= 0:
                x[j] = 0.0
                continue
            x[j] = max(0.0, x[j] + (atb[j] - ata[j] @ x) / ata[j, j])
        if np.abs(x - before).max() <= 1e-12 * max(1.0, np.abs(x).max()):
            break
    return x


class Calibrator:
    """Samples of (features, seconds) and when to propose a new model."""

    def __init__(self, current: tuple[float, ...]) -> None:
        self.current = current
        self.features: list[np.ndarray] = []
        self.seconds: list[float] = []
        self.since_change = 0
        self.since_fit = 0
        self.last_fit: Fit | None = None
        self.evidence: list[list[float]] = []  # [measured, predicted before, predicted after] of the last change
        self.current_error: float | None = None

    def add(self, features: np.ndarray, seconds: np.ndarray) -> None:
        for f, s in zip(np.asarray(features, dtype=np.float64), np.asarray(seconds, dtype=np.float64)):
            if math.isfinite(s) and s > 0:
                self.features.append(f)
                self.seconds.append(float(s))
                self.since_change += 1
                self.since_fit += 1
        if len(self.seconds) > WINDOW:
            del self.features[:-WINDOW], self.seconds[:-WINDOW]

    def propose(self) -> Fit | None:
        """A fit clearly better than the current model, or None."""
        if self.since_change < MIN_SAMPLES or self.since_fit < MIN_SAMPLES:
            return None
        self.since_fit = 0
        x, y = np.asarray(self.features), np.asarray(self.seconds)
        result = fit(x, y)
        self.last_fit = result
        self.current_error = scaled_error(x, y, self.current)
        if result.error <= (1 - MARGIN) * self.current_error and self.current_error - result.error >= ABS_MARGIN:
            # what `msd report` shows of the change: measured against predicted, before and after
            keep = np.linspace(0, len(y) - 1, min(len(y), EVIDENCE)).astype(int)
            before = scaled_prediction(x[keep], y[keep], self.current)
            after = x[keep] @ np.asarray(result.coefficients)
            self.evidence = [[float(m), float(b), float(a)] for m, b, a in zip(y[keep], before, after)]
            return result
        return None

    def adopted(self, coefficients: tuple[float, ...]) -> None:
        self.current = coefficients
        self.since_change = 0
