"""balance.calibrate, kept apart from the state machine: what each micro-batch of a recent step held
(its features as calibrate.TERMS), the compute times ranks report for them, and the cost models
adopted from those times.

A fit clearly better than the model planning now is adopted from the first step not planned yet:
the planner takes it (Planner.set_cost), the change is remembered here, journaled by the caller
and carried in checkpoints, so the stream stays a function of the job and the journal. The book
sends nothing and opens nothing; CoordinatorState asks it and turns its answers into instructions.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from msd_common.spec import CostConfig, JobConfig

from .balance import patch_ratio, patch_square_ratio
from .calibrate import TERMS, Calibrator, Fit
from .plan import LENGTH, POSITION, SOURCE, Planner, StepPlan

log = logging.getLogger("msd.coordinator")

FEATURE_STEPS = 64  # steps whose micro-batch features are kept for the compute times ranks report


def coefficients_of(model: CostConfig) -> list[float]:
    """A cost model as calibrate.TERMS (the constant per micro-batch is not the plan's: 0)."""
    return [model.quadratic, model.linear, 0.0, model.patch_quadratic, model.patch_linear]


class CalibrationBook:
    def __init__(self, job: JobConfig, planner: Planner, dp_rank_of: Callable[[int], int],
                 cost_changes: list[tuple[int, list[float]]] = ()) -> None:
        """cost_changes: models calibrated earlier in the run, (from step, coefficients as TERMS)."""
        self.job = job
        self.planner = planner
        self.dp_rank_of = dp_rank_of
        self.changes: list[tuple[int, list[float]]] = []  # models adopted, in order
        for at_step, coefficients in cost_changes:
            self.replay(at_step, coefficients)
        self.calibrator = Calibrator(tuple(coefficients_of(planner.cost_at(1 << 62))))
        self.features: dict[int, np.ndarray] = {}  # step -> [dp rank, micro-batch, TERMS]
        self.last_fit: Fit | None = None

    def replay(self, at_step: int, coefficients: list[float]) -> bool:
        """A change made earlier in the run (the cost journal, a carried state); False if known."""
        if any(at_step == a for a, _ in self.changes):
            return False
        q, lin, _, pq, pl = (list(coefficients) + [0.0] * 5)[:5]
        self.planner.set_cost(at_step, CostConfig(float(q), float(lin), float(pq), float(pl)), replaying=True)
        self.changes.append((at_step, [float(c) for c in coefficients]))
        return True

    def planned(self, plan: StepPlan,
                patches_of: Callable[[int, np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]) -> None:
        """What each (dp rank, micro-batch) of a step holds, as TERMS, for the times its ranks will
        report. An image-text piece's patches are its record's patches, a fragment charged its
        share (as balance.Cost does), whatever the job's model says of patches: a fit may find a
        patch cost the job file left out. patches_of(source, positions): (patches, lengths, each
        record's images' patches squared, summed: the quadratic term is per image)."""
        lengths = plan.pieces[:, LENGTH].astype(np.float64)
        mbs = self.job.micro_batches_per_rank
        cell = plan.rank * mbs + plan.micro_batch
        features = np.zeros((self.job.dp * mbs, len(TERMS)))
        features[:, 0] = np.bincount(cell, weights=lengths * lengths, minlength=len(features))
        features[:, 1] = np.bincount(cell, weights=lengths, minlength=len(features))
        features[:, 2] = 1.0
        image_sources = [s.index for s in self.job.sources if s.has_encoder_cost]
        if image_sources:
            patches, squares = np.zeros(len(plan.pieces)), np.zeros(len(plan.pieces))
            for s in image_sources:
                mine = np.flatnonzero(plan.pieces[:, SOURCE] == s)
                if len(mine):
                    record_patches, record_lengths, record_squares = patches_of(s, plan.pieces[mine, POSITION])
                    patches[mine] = patch_ratio(record_patches, record_lengths) * lengths[mine]
                    squares[mine] = patch_square_ratio(record_squares, record_lengths) * lengths[mine] ** 2
            features[:, 3] = np.bincount(cell, weights=squares, minlength=len(features))
            features[:, 4] = np.bincount(cell, weights=patches, minlength=len(features))
        self.features[plan.step] = features.reshape(self.job.dp, mbs, len(TERMS))
        for old in [s for s in self.features if s < plan.step - FEATURE_STEPS]:
            del self.features[old]

    def timed(self, rank: int, step: int, seconds: list, next_step: int) -> tuple[int, Fit] | None:
        """One rank's compute times of one step's micro-batches. Returns (from step, fit) when a fit
        is adopted (from next_step, the first step not planned yet): the caller journals it."""
        features = self.features.get(step)
        if features is None:
            return None
        times = np.asarray(seconds, dtype=np.float64)[:features.shape[1]]
        self.calibrator.add(features[self.dp_rank_of(rank), :len(times)], times)
        fit = self.calibrator.propose()
        self.last_fit = self.calibrator.last_fit or self.last_fit
        if fit is None:
            return None
        q, lin, _, pq, pl = fit.coefficients
        self.planner.set_cost(next_step, CostConfig(q, lin, pq, pl))
        self.calibrator.adopted(fit.coefficients)
        self.changes.append((next_step, list(fit.coefficients)))
        log.warning("cost model calibrated from %d micro-batch times (error %.3f, the model's %.3f): %s from step %d",
                    fit.samples, fit.error, self.calibrator.current_error or float("nan"),
                    ", ".join(f"{t} {c:.4g}" for t, c in zip(TERMS, fit.coefficients)), next_step)
        return next_step, fit

    def status(self, next_step: int) -> dict[str, Any]:
        """The model planning now, the step it took effect, and the last fit."""
        at = max((a for a, _ in self.changes if a <= next_step), default=0)
        model = self.changes[-1][1] if self.changes else coefficients_of(self.job.cost)
        fit = self.last_fit
        return {"calibrate": self.job.calibrate, "coefficients": dict(zip(TERMS, model)), "from_step": at,
                "changes": [[a, dict(zip(TERMS, c))] for a, c in self.changes],
                "samples": len(self.calibrator.seconds),
                "fit": None if fit is None else {"coefficients": dict(zip(TERMS, fit.coefficients)),
                                                 "error": round(fit.error, 4), "samples": fit.samples},
                "model_error": None if self.calibrator.current_error is None else
                round(self.calibrator.current_error, 4)}
