"""`msd mix`: ask a running coordinator to use new mixture weights from a later step on; the
coordinator's check of such a request (`check_weights`); and the run's mixture changes
(`MixtureChanges`: `msd mix`'s and mixture.adapt's, journaled before anything is planned with them)."""

from __future__ import annotations

import logging
import math
from typing import Any

from msd_common import protocol as P

from .instructions import AppendMixture, Instruction

log = logging.getLogger("msd.coordinator")


class MixtureChanges:
    """Weights changed at run time, in the order made; the planner plans with them."""

    def __init__(self, planner: Any, names: list[str], durable: bool) -> None:
        self.planner, self.names, self.durable = planner, names, durable
        self.changes: list[tuple[int, list[float]]] = []

    def replay(self, at_step: int, weights: list[float]) -> None:
        """A change made earlier in the run (the mixture journal, a carried state)."""
        self.planner.set_weights(at_step, weights, replaying=True)
        self.changes.append((at_step, list(weights)))
        log.info("mixture journal: weights %s from step %d", weights, at_step)

    def change(self, at_step: int, weights: list[float], why: str) -> list[Instruction]:
        """New weights from a step not planned yet; what to journal first (durable runs)."""
        self.planner.set_weights(at_step, weights)
        self.changes.append((at_step, weights))
        log.warning("mixture changed from step %d (%s): %s", at_step, why, dict(zip(self.names, weights)),
                    extra={"step": at_step})
        return [AppendMixture(at_step, tuple(weights))] if self.durable else []


def parse_weights(items: tuple[str, ...]) -> dict[str, float]:
    """["web=0.5", "code=0.5"] -> {"web": 0.5, "code": 0.5}; ValueError naming the bad item."""
    weights: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"{item!r}: expected SOURCE=WEIGHT")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"{item!r}: {value!r} is not a number") from None
    return weights


def request_mix(address: str, at_step: int, weights: dict[str, float], timeout_s: float = 10.0,
                keys_dir: str | None = None) -> tuple[bool, str]:
    """Send the change and wait for the coordinator's answer: (accepted, reason if not).
    address: one, or a primary and its standbys (comma-separated); keys_dir: the job's key
    directory (a job with security.curve takes changes only from its operator key)."""
    from .control import NoAnswer, ask

    try:
        reply = ask(address, P.MixRequest(at_step=at_step, weights=weights), timeout_s, keys_dir)
    except NoAnswer as e:
        return False, str(e)
    return bool(reply.ok), reply.reason


def check_weights(names: list[str], next_step: int, at_step: int, raw: Any) -> tuple[list[float] | None, str]:
    """A mix_request's weights as a list in source order, or None and what is wrong with them (every
    problem, named): a map of known source names to finite weights >= 0, not all zero, from a step
    not planned yet."""
    problems = []
    if not isinstance(raw, dict) or not raw:
        problems.append("weights: expected a non-empty map of source name -> weight")
        raw = {}
    for name, w in raw.items():
        if name not in names:
            problems.append(f"{name}: unknown source (sources: {', '.join(names)})")
        elif type(w) not in (int, float) or not math.isfinite(w) or w < 0:
            problems.append(f"{name}: weight must be a finite number >= 0, got {w!r}")
    if not problems and sum(raw.values()) <= 0:
        problems.append("weights: all zero")
    if at_step < next_step:
        problems.append(f"step {at_step} is already planned (the plan stands at step {next_step}); choose a later "
                        "step")
    if problems:
        return None, "; ".join(problems)
    return [float(raw.get(name, 0.0)) for name in names], ""
