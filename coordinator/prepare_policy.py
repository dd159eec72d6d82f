"""What to prepare and when: the policy of the prepare path, apart from the state machine that
carries it out (coordinator/state.py decides which worker does a task and records the results).

Per source, as arrays over the sources (at hundreds of sources a Python pass per source on every
planning pass was a tenth of the coordinator's CPU):
- `records_per_step`: records of each source a step uses at the current weights (now, or at the
  end of the look-ahead if higher) and the mean record length reported so far;
- `task_sizes`: records per prepare task;
- `windows`: records to keep prepared ahead of each source's cursor;
- `short`: the sources to refill now.
"""

from __future__ import annotations

import numpy as np

from msd_common.spec import JobConfig
from .lead import PrepareLead

PRIOR_RECORDS = 8  # the mean record length starts as this many records of a quarter row each


class PreparePolicy:
    def __init__(self, job: JobConfig, full_tasks: np.ndarray, task_block: np.ndarray, lead: PrepareLead) -> None:
        """full_tasks: sources whose tasks are always full (memory-mapped ones, prepared here from
        their index; those in object storage, a task being one round of requests); task_block:
        each source's shuffle_block (tasks of whole blocks)."""
        self.job = job
        self.full_tasks = np.asarray(full_tasks, dtype=bool)
        self.task_block = np.asarray(task_block, dtype=np.int64)
        self.lead = lead

    def records_per_step(self, step: int, weights_now: list[float], weights_ahead: list[float],
                         len_sum: list[int], len_count: list[int]) -> np.ndarray:
        """Records of each source a step uses (0 for a source without weight)."""
        w = np.maximum(weights_now, weights_ahead)
        # The mean length prepared so far, pulled towards a quarter row by PRIOR_RECORDS of that
        # length: a first task of skipped records (mean 0) sized the window at a step's tokens
        # per record, a flood of tasks that kept the workers from delivering (found by msd.sim)
        prior = self.job.batch.seq_len / 4
        mean_len = ((np.asarray(len_sum, dtype=np.float64) + PRIOR_RECORDS * prior)
                    / (np.asarray(len_count, dtype=np.float64) + PRIOR_RECORDS))
        return np.where(w > 0, w * self.job.step_tokens_at(step) / np.maximum(mean_len, 1.0), 0.0)

    def task_sizes(self, per_step: np.ndarray) -> np.ndarray:
        """Records per prepare task of each source: prepare_batch, or fewer for a source a step
        uses little of (with many sources, a full batch each would hold far more prepared data
        than needed). A memory-mapped source's records are prepared by the coordinator from its
        index and cost a worker nothing to hold, so its tasks are always full: with hundreds of
        sources, a task of one or two records per source per step made the coordinator's step
        O(sources) in small numpy calls. A source in object storage has full tasks too: a task is
        a round of requests, and its latency, not its size, is what a worker waits for. A source
        shuffled in blocks (shuffle_block) has tasks of whole blocks: a task is then a few runs of
        consecutive records, a request each."""
        batch = self.job.runtime.prepare_batch
        full = -(-batch // self.task_block) * self.task_block  # prepare_batch rounded up to whole blocks
        return np.where(self.full_tasks, full, np.clip(np.ceil(per_step), 1, full)).astype(np.int64)

    def windows(self, per_step: np.ndarray, task: np.ndarray) -> np.ndarray:
        """Records to keep prepared ahead of each source's cursor: enough steps to cover its
        prepare round trip (`lead.py`), and a task. A source of full tasks keeps the whole
        look-ahead: it is refilled only when short by a whole task, so the look-ahead is its only
        margin. For a memory-mapped one (prepared from the index, held by a worker for nothing) a
        narrower window made the planner stop mid-step for lengths (55 against 36 ms of CPU per
        step at DP 512 with 306 sources, tools/bench_scale.py), and one in object storage waits a
        round of requests per task."""
        steps = np.where(self.full_tasks, float(self.lead.most), self.lead.steps_ahead())
        ahead = np.ceil(steps * per_step).astype(np.int64) + task
        return np.where(per_step > 0, ahead, 0)

    def short(self, per_step: np.ndarray, task: np.ndarray, window: np.ndarray,
              prepared_ahead: np.ndarray) -> np.ndarray:
        """The sources to refill: those whose records prepared ahead of the cursor fall below
        their window. A source of full tasks is refilled only once it is short by a whole task:
        one full task every prepare_batch records, not a small one every step."""
        return np.flatnonzero((per_step > 0) & (prepared_ahead <= window - np.where(self.full_tasks, task, 1)))
