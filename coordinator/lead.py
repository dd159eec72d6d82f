"""How many steps ahead of the plan each source keeps records prepared.

The plan already runs `lookahead_steps` ahead of the slowest rank, and those steps are delivered
as soon as they are planned: that buffer is what hides a slow worker from the trainers. Records
prepared ahead of the plan only have to hide the prepare round trip (task sent, read, tokenized,
lengths back) from the planner, so each source keeps one step, plus its round trip in steps
(and the coordinator adds one task's records, as refills come in whole tasks), at most
`lookahead_steps` + 1 steps, which every source kept before: at 8 ranks of 64 JSONL sources
the worker held 5-6 steps of tokens (8-13 MB) for round trips of a few hundredths of a step
(tools/bench_e2e.py). Sources prepared in full tasks (memory-mapped ones, whose records the
coordinator prepares from their index, and those in object storage) keep the whole look-ahead
(`PreparePolicy.windows`, prepare_policy.py). Until the pace is known (the first steps), one step: the first
steps wait for their round trips anyway, and a start with the whole look-ahead left the worker's
heap with 2-3 MB of freed fragments for good.

A source's round trip (from the task being handed to a worker to its result) is a decaying
maximum: a slow task widens its window at once, and the window narrows again over a few tasks
(the start of a job, when every source's first tasks queue on the first workers, was still
widening windows fifteen steps later with a slower decay). The step time is the median of the
slowest rank's last intervals between steps (the burst of buffered steps at the start, or a
pause for a checkpoint, moves it little). If a round trip outgrows the window all the same, the
planner waits for that source's records while the trainers use the planned steps, and the next
sample widens the window. Part of the coordinator's state: times come from events, never from a
clock.
"""

from __future__ import annotations

import collections
import statistics

import numpy as np

ROUND_TRIP_DECAY = 0.5  # a source's round-trip estimate halves with every task that was faster


class PrepareLead:
    def __init__(self, n_sources: int, lookahead_steps: int) -> None:
        self.most = lookahead_steps + 1
        self.round_trip_s = np.zeros(n_sources)
        self.step_s: float | None = None
        # The step time is the median of the last 2 x lookahead_steps + 1 intervals, once there are
        # that many: the first lookahead_steps steps come in a burst (they were planned and
        # delivered ahead), and one burst interval of 11 ms as the step time had widened every
        # window to the whole look-ahead at step 4, leaving the worker's heap fragmented.
        self._intervals: collections.deque[float] = collections.deque(maxlen=2 * lookahead_steps + 1)
        self._last: tuple[float, int] | None = None  # (time, step) the slowest rank last reached
        self.version = 0  # changes whenever steps_ahead() may

    def task_done(self, source: int, seconds: float) -> None:
        """A prepare task of `source` came back `seconds` after it was issued."""
        was = self.round_trip_s[source]
        self.round_trip_s[source] = max(seconds, was * ROUND_TRIP_DECAY)
        if self.round_trip_s[source] != was:
            self.version += 1

    def consumed(self, at: float, slowest: int) -> None:
        """The slowest rank has consumed step `slowest` (seen at time `at`)."""
        if self._last is not None and slowest > self._last[1]:
            self._intervals.append((at - self._last[0]) / (slowest - self._last[1]))
            if len(self._intervals) == self._intervals.maxlen:
                self.step_s = statistics.median(self._intervals)
                self.version += 1
        if self._last is None or slowest > self._last[1]:
            self._last = (at, slowest)

    def forget_pace(self) -> None:
        """The plan was rewound or the ranks left: their pace is measured again."""
        self._last = None

    def steps_ahead(self) -> np.ndarray:
        """Per source, the steps of records to keep prepared ahead of the plan's cursor."""
        if not self.step_s or self.step_s <= 0:
            return np.ones(len(self.round_trip_s))
        return np.minimum(1.0 + self.round_trip_s / self.step_s, self.most)
