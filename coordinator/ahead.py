"""How many bytes beside the tokens each rank has coming: the steps planned ahead of the slowest
rank, and their image frames and processor arrays per data-parallel rank (`runtime.ahead_bytes`).

The plan runs `lookahead_steps` ahead, and its steps' pieces are delivered as soon as they are
prepared: a rank holds what it was sent until it trains on it. With text that is a few megabytes;
with images of a megapixel and more, or long videos, a few steps ahead are gigabytes per rank.
Workers report each record's array bytes when they prepare it (`prepared.array_bytes`); here each
planned step's bytes are summed per DP rank (a sample's arrays go with its first piece), and the
state plans no further step while the steps ahead of the slowest rank hold `ahead_bytes` for some
rank. The next step a rank needs is always planned: one step larger than the budget is still
delivered, so nothing ever waits on the budget alone."""

from __future__ import annotations

from typing import Callable

import numpy as np

from .plan import OFFSET, POSITION, SOURCE, StepPlan


class AheadBytes:
    def __init__(self, budget: int, ranks: int) -> None:
        self.budget = budget
        self.ranks = ranks
        self.by_step: dict[int, np.ndarray] = {}  # step -> bytes per DP rank (steps with any)

    def planned(self, plan: StepPlan, nbytes: Callable[[int, np.ndarray], np.ndarray]) -> None:
        """A step was planned: its bytes per rank. nbytes(source, positions): each record's array bytes."""
        first = plan.pieces[:, OFFSET] == 0
        if not first.any():
            return
        per_rank = np.zeros(self.ranks, np.int64)
        sources = plan.pieces[first, SOURCE]
        for s in np.unique(sources).tolist():
            mine = first & (plan.pieces[:, SOURCE] == s)
            sizes = nbytes(int(s), plan.pieces[mine, POSITION].astype(np.int64))
            if sizes.any():
                np.add.at(per_rank, plan.rank[mine].astype(np.int64), sizes)
        if per_rank.any():
            self.by_step[plan.step] = per_rank
        else:
            self.by_step.pop(plan.step, None)

    def consumed_through(self, step: int) -> None:
        """Every rank has trained on the steps up to `step`: they are no longer ahead."""
        for s in [s for s in self.by_step if s <= step]:
            del self.by_step[s]

    def forget_from(self, step: int) -> None:
        """The plan restarts at `step` (a rewind): the steps from there are planned again."""
        for s in [s for s in self.by_step if s >= step]:
            del self.by_step[s]

    def held(self) -> int:
        """The most any rank has coming in the steps ahead."""
        if not self.by_step:
            return 0
        return int(np.sum(list(self.by_step.values()), axis=0).max())

    def full(self) -> bool:
        return self.held() >= self.budget
