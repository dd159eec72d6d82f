"""Mixing that learns from the trainer's loss (`mixture.adapt`): the ranks report their training
loss per source with their `consumed`, and every `every_steps` steps a policy maps the losses to new
weights, journaled as a mixture change exactly as `msd mix` writes one.

When a change applies is fixed by the step, not by the timing. The losses of step k arrive with
each rank's `consumed` of step k+1 (the client sums them while the trainer computes the next step).
A decision taken after step k applies from step k + lookahead_steps + 2: the first step the plan
could need once every rank has consumed step k+1, so the plan never waits for a decision in steady
state, and no step past a pending decision's is planned before it is taken (`holds`). A decision
uses what the ranks reported for step k, one report per data-parallel rank; a rank that reports no
loss counts for nothing. Decisions already journaled are replayed from the journal and not taken
again (a resume, a standby taking over); a decision whose losses went with a coordinator that
crashed before taking it is taken on what reached this one (often nothing: the weights stay).

Policies are small pure functions of the step and the sources' histories (mean loss and tokens per
window, the weights in force): `policy(step, history) -> {source: weight}`. A user's own is named as
`package.module:function`. A policy that raises, or returns weights that are not a distribution over
the sources it adapts, keeps the last weights and is named in status.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from msd_common.protocol import RELAY_LOSS
from msd_common.spec import AdaptConfig

log = logging.getLogger("msd.coordinator")


@dataclass
class History:
    """What a policy sees: per source (by name), one entry per window of `every_steps` steps."""

    steps: list[int] = field(default_factory=list)  # the last step of each window
    loss: dict[str, list[float]] = field(default_factory=dict)  # mean loss per token (nan: no tokens)
    tokens: dict[str, list[int]] = field(default_factory=dict)  # tokens trained on
    weights: dict[str, float] = field(default_factory=dict)  # in force now, over the adapted sources


Policy = Callable[[int, History], dict[str, float]]


def loss_share(step: int, history: History) -> dict[str, float]:
    """Weights in proportion to each source's mean loss over the last window: what is learnt least
    is drawn most. A source without tokens in the window keeps its weight's share."""
    last = {s: values[-1] for s, values in history.loss.items()}
    known = {s: v for s, v in last.items() if math.isfinite(v) and v > 0}
    if not known:
        return dict(history.weights)
    mass = sum(history.weights[s] for s in known)
    total = sum(known.values())
    return {s: (mass * known[s] / total if s in known else w) for s, w in history.weights.items()}


def odm(step: int, history: History) -> dict[str, float]:
    """Online Data Mixing (Albalak et al. 2023): EXP3 over the sources, the reward of a source its
    mean training loss in the window, importance-weighted by the probability it was drawn with; the
    cumulative rewards are carried in the weights themselves (a multiplicative update), so the policy
    needs the weights in force and the last window only. Exploration ε_t = min(1/K, sqrt(ln K / (K t)))."""
    sources = list(history.weights)
    k = len(sources)
    t = max(1, len(history.steps))
    eps = min(1.0 / k, math.sqrt(math.log(k) / (k * t))) if k > 1 else 0.0
    scores = {}
    for s in sources:
        p = max(history.weights[s], 1e-12)
        reward = history.loss[s][-1] if history.loss.get(s) and math.isfinite(history.loss[s][-1]) else 0.0
        scores[s] = math.log(p) + eps * reward / p
    top = max(scores.values())
    raw = {s: math.exp(v - top) for s, v in scores.items()}
    total = sum(raw.values())
    return {s: (1 - k * eps) * raw[s] / total + eps for s in sources}


def ado(step: int, history: History) -> dict[str, float]:
    """After ADO (2024), reduced: each source's loss against its cumulative tokens is fitted with a
    power law L = a * n^-b (least squares in log-log over the windows so far); a source's preference
    is what its next tokens are predicted to teach, b * L(n) (the loss drop per relative growth of
    its data). The weights go toward the preferences as far as max_step_change lets them in one
    decision. With fewer than three windows of a source, its weight stays."""
    prefs: dict[str, float] = {}
    for s, losses in history.loss.items():
        cumulative, points = 0, []
        for loss, tokens in zip(losses, history.tokens.get(s, [])):
            cumulative += tokens
            if tokens > 0 and math.isfinite(loss) and loss > 0:
                points.append((math.log(cumulative), math.log(loss)))
        if len(points) < 3:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        var = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (y - my) for x, y in points) / var if var > 0 else 0.0
        prefs[s] = max(0.0, -slope) * math.exp(points[-1][1])
    if not prefs or sum(prefs.values()) <= 0:
        return dict(history.weights)
    mass = sum(history.weights[s] for s in prefs)
    total = sum(prefs.values())
    return {s: (mass * prefs[s] / total if s in prefs else w) for s, w in history.weights.items()}


BUILT_IN: dict[str, Policy] = {"odm": odm, "ado": ado, "loss_share": loss_share}


def load_policy(name: str) -> Policy:
    """A built-in policy, or the user's `package.module:function`."""
    if name in BUILT_IN:
        return BUILT_IN[name]
    from msd_common.usercode import load

    return load(name)


def constrain(proposed: dict[str, float], current: dict[str, float], config: AdaptConfig) -> dict[str, float]:
    """The policy's weights over the adapted sources, made a distribution over their current mass
    with every weight at min_weight or more, then moved from the current weights only part of the
    way where a source would move more than max_step_change (the whole change scaled down, so the
    sum stays and no weight falls below the floor). Raises ValueError when they are not weights."""
    if set(proposed) != set(current):
        raise ValueError(f"weights for {sorted(proposed)}, expected {sorted(current)}")
    if any(not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0 for w in proposed.values()):
        raise ValueError(f"weights must be finite and >= 0, got {proposed}")
    if sum(proposed.values()) <= 0:
        raise ValueError("weights are all zero")
    mass = sum(current.values())
    target = _floored(proposed, config.min_weight * mass, mass)
    furthest = max(abs(target[s] - current[s]) for s in current)
    part = min(1.0, config.max_step_change / furthest) if furthest > 0 else 1.0
    return {s: current[s] + part * (target[s] - current[s]) for s in current}


def _floored(weights: dict[str, float], floor: float, mass: float) -> dict[str, float]:
    """`weights` scaled to sum to `mass` with none below `floor` (those raised to it, the rest
    scaled down in proportion)."""
    fixed: set[str] = set()
    while True:
        free = {s: w for s, w in weights.items() if s not in fixed}
        left, total = mass - floor * len(fixed), sum(free.values())
        scaled = {s: (w * left / total if total > 0 else left / len(free)) for s, w in free.items()}
        low = {s for s, w in scaled.items() if w < floor}
        if not low:
            return {**{s: floor for s in fixed}, **scaled}
        fixed |= low


@dataclass
class Decision:
    at_step: int  # the first step planned with the new weights
    weights: list[float]  # every source's, in source order


class AdaptBook:
    """The ranks' reported losses per step, the policy's decisions, and what status shows."""

    def __init__(self, config: AdaptConfig, names: list[str], lookahead_steps: int, dp_of: Callable[[int], int],
                 journaled: list[int], next_step: int) -> None:
        self.config, self.names, self.dp_of = config, names, dp_of
        self.delay = lookahead_steps + 2
        self.policy = load_policy(config.policy)
        self.adapted = [n for n in names if not config.sources or n in config.sources]
        self.reports: dict[int, dict[int, dict[int, tuple[float, int]]]] = {}  # step -> dp rank -> source -> sums
        # relays' loss tables (RELAY_LOSS rows, summed losses), kept as they came until their steps fold
        self.tables: list[tuple[np.ndarray, np.ndarray]] = []
        self._dp_of_rank = np.zeros(0, np.int64)  # rank -> data-parallel rank, for the tables
        self._peers = False  # whether some ranks share a data-parallel rank
        self.history = History(loss={n: [] for n in self.adapted}, tokens={n: [] for n in self.adapted})
        # per adapted source: each gathered step's loss sum, and the tokens, since the last decision
        self.window: dict[str, list] = {n: [[], 0] for n in self.adapted}
        self.taken = set(journaled)  # apply steps already decided (the journal's changes)
        self.first_open = next_step  # decisions applying before this are planned already
        self.next_k = self.first_decision()  # the next step after which a decision is due
        while self.next_k + self.delay < next_step:  # (planned already: their windows' losses are gone)
            self.next_k += config.every_steps
        # the steps up to this one are in the window or the history (a restart: those before the open window)
        self.gathered = self.next_k - config.every_steps if self.next_k > self.first_decision() else -1
        self.failed: str | None = None  # the last policy failure, for status

    def first_decision(self) -> int:
        """The first step after which a decision is taken (then every `every_steps`)."""
        return max(self.config.warmup_steps, self.config.every_steps) - 1

    def report(self, rank: int, loss_step: int, sources: list[int], sums: list[float], tokens: list[int]) -> None:
        """A rank's losses of `loss_step`, one report per data-parallel rank (tensor-parallel peers
        report the same)."""
        if loss_step < 0 or not sources or loss_step < self.next_k - self.config.every_steps:
            return
        by_dp = self.reports.setdefault(loss_step, {})
        dp = self.dp_of(rank)
        if dp not in by_dp:
            by_dp[dp] = {int(s): (float(x), int(n)) for s, x, n in zip(sources, sums, tokens)}

    def report_table(self, table: np.ndarray, sums: np.ndarray) -> None:
        """A relay's losses: RELAY_LOSS rows (rank, step, source, tokens) and their summed losses,
        counted as `report` counts a rank's when their steps fold."""
        self.tables.append((table, sums))

    def holds(self, step: int) -> bool:
        """Whether `step` must wait for a decision not taken yet."""
        return self.next_k + self.delay <= step

    def decide(self, slowest: int, weights_at: Callable[[int], list[float]]) -> list[Decision]:
        """Every decision whose step's losses are all in (each rank has consumed the step after),
        in order: the new weights where they change. Steps whose losses are all in are folded into
        the window as they complete, so the book holds the steps in flight only."""
        out = []
        while True:
            self._gather(min(slowest - 1, self.next_k))
            if self.next_k + 1 > slowest:
                return out
            k, at = self.next_k, self.next_k + self.delay
            self.next_k += self.config.every_steps
            self._close(k)
            if at in self.taken or at < self.first_open:
                continue
            self.taken.add(at)
            decision = self._decide(k, at, weights_at(at))
            if decision is not None:
                out.append(decision)

    def _gather(self, upto: int) -> None:
        """The losses of the steps after those gathered, up to `upto` (every one complete), into the
        window: per source, each step's loss summed exactly (math.fsum), so neither the order the
        reports came in nor when they were gathered changes a bit of the window's total."""
        if upto <= self.gathered:
            return
        after, self.gathered = self.gathered, upto
        per_step: dict[int, dict[int, tuple[list[float], int]]] = {}
        direct = []  # (step, dp rank) whose report came from the rank itself
        for step in [s for s in self.reports if s <= upto]:
            for dp, by_source in self.reports.pop(step).items() if step > after else ():
                direct.append((step, dp))
                for source, (loss, n) in by_source.items():
                    parts, tokens = per_step.setdefault(step, {}).get(source, ([], 0))
                    parts.append(loss)
                    per_step[step][source] = (parts, tokens + n)
        for (step, source), (losses, n) in self._table_rows(after, upto, direct).items():
            parts, tokens = per_step.setdefault(step, {}).get(source, ([], 0))
            per_step[step][source] = (parts + losses, tokens + n)
        for step in sorted(per_step):
            for source, (parts, n) in per_step[step].items():
                name = self.names[source] if 0 <= source < len(self.names) else None
                if name in self.window:
                    self.window[name][0].append(math.fsum(parts))
                    self.window[name][1] += n

    def _close(self, k: int) -> None:
        """The window of the decision after step k closes into the history."""
        if self.history.steps and self.history.steps[-1] >= k:
            return
        self.history.steps.append(k)
        for name, (parts, n) in self.window.items():
            self.history.loss[name].append(math.fsum(parts) / n if n else float("nan"))
            self.history.tokens[name].append(int(n))
        self.window = {n: [[], 0] for n in self.adapted}

    def _table_rows(self, after: int, upto: int, direct: list[tuple[int, int]]) -> dict:
        """The relays' rows of the steps after `after` up to `upto`, as (step, source) -> (loss sums,
        tokens), counted as `report` counts: one report per data-parallel rank and step (the lowest
        rank's rows: its tensor-parallel peers report the same), none where the rank's own report
        came. Rows of later steps are kept, of earlier ones dropped."""
        if not self.tables:
            return {}
        table = np.concatenate([t for t, _ in self.tables])
        sums = np.concatenate([x for _, x in self.tables])
        steps = table[:, RELAY_LOSS.step]
        due = steps <= upto
        self.tables = [(table[~due], sums[~due])] if not due.all() else []
        due &= steps > after
        table, sums, steps = table[due], sums[due], steps[due]
        ranks = table[:, RELAY_LOSS.rank]
        key = steps << 32 | self._dp_ranks(ranks)
        keep = np.ones(len(key), bool)
        if self._peers:  # ranks that share a data-parallel rank (tensor, pipeline or context parallel)
            order = np.lexsort((ranks, key))
            first = np.r_[True, key[order][1:] != key[order][:-1]]  # each (step, dp)'s lowest rank starts its run
            lowest = np.maximum.accumulate(np.where(first, np.arange(len(order)), 0))
            keep[order] = ranks[order] == ranks[order][lowest]
        if direct:
            keep &= ~np.isin(key, [s << 32 | d for s, d in direct])
        group = (steps << 32 | table[:, RELAY_LOSS.source])[keep]  # (step, source)
        order = np.argsort(group, kind="stable")
        group, sums, tokens = group[order], sums[keep][order], table[keep, RELAY_LOSS.tokens][order]
        starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]]).tolist() if len(group) else []
        out = {}
        for a, b in zip(starts, starts[1:] + [len(group)]):
            out[(int(group[a] >> 32), int(group[a] & 0xFFFFFFFF))] = (sums[a:b].tolist(), int(tokens[a:b].sum()))
        return out

    def _dp_ranks(self, ranks: np.ndarray) -> np.ndarray:
        """Each rank's data-parallel rank (a lookup table, grown to the highest rank seen)."""
        top = int(ranks.max()) + 1 if len(ranks) else 0
        if len(self._dp_of_rank) < top:
            self._dp_of_rank = np.array([self.dp_of(r) for r in range(top)], np.int64)
            self._peers = len(np.unique(self._dp_of_rank)) < top
        return self._dp_of_rank[ranks]

    def _decide(self, k: int, at: int, weights: list[float]) -> Decision | None:
        current = {n: weights[self.names.index(n)] for n in self.adapted}
        self.history.weights = dict(current)
        try:
            proposed = self.policy(k, self.history)
            new = constrain({n: float(proposed[n]) for n in self.adapted} if isinstance(proposed, dict) and
                            set(proposed) >= set(self.adapted) else proposed, current, self.config)
        except Exception as e:  # noqa: BLE001 - a user's policy never stops the job
            self.failed = f"step {k}: policy {self.config.policy} failed: {type(e).__name__}: {e}"
            log.warning("mixture.adapt: %s; the weights stay", self.failed, extra={"step": k})
            return None
        self.failed = None
        if all(abs(new[n] - current[n]) < 1e-12 for n in self.adapted):
            return None
        full = list(weights)
        for n, w in new.items():
            full[self.names.index(n)] = w
        return Decision(at, full)

    def status(self) -> dict[str, Any]:
        last = {n: (values[-1] if values and math.isfinite(values[-1]) else None)
                for n, values in self.history.loss.items()}
        return {"policy": self.config.policy, "every_steps": self.config.every_steps,
                "decisions": len(self.history.steps), "last_loss": last,
                "weights": dict(self.history.weights), "failed": self.failed}
