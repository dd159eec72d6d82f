"""The task book: every prepare task from creation until its result is in.

A task asks one worker to read and transform some records of one source (the stream positions
of a `PositionTable`). Its life: *queued* (waiting for a worker; new tasks and tasks whose worker
died or failed them) -> *in flight* on one worker -> gone (the result came, or the plan was
rewound). The queue is first in, first out; `attempts` counts how many times a task was handed
to a worker, and `deaths` how many worker processes died while working on it.

Which task killed a worker is reported by its host agent (the worker marks the task it works on
in memory shared with the agent): the coordinator blames that task (`state._blame`), and a record
that killed ALLOWED_DEATHS workers is quarantined. Dask's `allowed-failures` works the same way.
Part of the coordinator's state: no sockets, no clock.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np


@dataclass
class PrepareTask:
    task_id: int
    source: int
    positions: np.ndarray  # stream positions of the source
    worker_id: int | None = None  # None: queued
    estimate_s: float = 0.0  # expected seconds of work (the owner's backlog counts it)
    attempts: int = 0  # times handed to a worker
    avoid: int | None = None  # a worker that failed it: another one, if there is one
    deaths: int = 0  # worker processes that died while this was the task they worked on
    workers: list[int] = field(default_factory=list)  # every worker it was handed to, in order
    assigned_at: float = 0.0  # when it was last handed to a worker (event time): its round trip ends with the result


class TaskBook:
    def __init__(self) -> None:
        self._tasks: dict[int, PrepareTask] = {}
        self._queue: collections.deque[PrepareTask] = collections.deque()
        self._by_worker: dict[int, set[int]] = {}
        self._backlog: dict[int, float] = {}
        self._next_id = 0

    def __len__(self) -> int:
        return len(self._tasks)

    def new(self, source: int, positions: np.ndarray, deaths: int = 0) -> PrepareTask:
        """A task for these positions, at the end of the queue."""
        task = PrepareTask(self._next_id, source, positions, deaths=deaths)
        self._next_id += 1
        self._tasks[task.task_id] = task
        self._queue.append(task)
        return task

    def queued(self) -> list[PrepareTask]:
        """Take every queued task out of the queue, oldest first (the caller assigns each)."""
        out = list(self._queue)
        self._queue.clear()
        return out

    def requeue(self, task: PrepareTask) -> None:
        """Back to the end of the queue (no worker could take it now)."""
        self._queue.append(task)

    def assign(self, task: PrepareTask, worker_id: int, estimate_s: float, at: float = 0.0) -> None:
        """The task goes to this worker (it must not be in flight elsewhere), at time `at`."""
        assert task.worker_id is None, f"task {task.task_id} is in flight on worker {task.worker_id}"
        task.worker_id, task.estimate_s, task.assigned_at = worker_id, estimate_s, at
        task.attempts += 1
        task.workers.append(worker_id)
        self._by_worker.setdefault(worker_id, set()).add(task.task_id)
        self._backlog[worker_id] = self._backlog.get(worker_id, 0.0) + estimate_s

    def _unassign(self, task: PrepareTask) -> None:
        wid = task.worker_id
        if wid is None:
            return
        mine = self._by_worker.get(wid)
        if mine is not None:
            mine.discard(task.task_id)
            if not mine:
                del self._by_worker[wid]
                self._backlog.pop(wid, None)
            else:
                self._backlog[wid] = max(0.0, self._backlog[wid] - task.estimate_s)
        task.worker_id = None

    def complete(self, task_id: int, worker_id: int) -> PrepareTask | None:
        """The result of a task came from `worker_id`: the task, done and out of the book, or
        None when that worker does not hold it (unknown, finished, or handed to another since)."""
        task = self._tasks.get(task_id)
        if task is None or task.worker_id != worker_id:
            return None
        self._unassign(task)
        del self._tasks[task_id]
        return task

    def fail(self, task_id: int, worker_id: int) -> PrepareTask | None:
        """The worker could not do the task: back to the queue, to go to another worker."""
        task = self._tasks.get(task_id)
        if task is None or task.worker_id != worker_id:
            return None
        self._unassign(task)
        task.avoid = worker_id
        self._queue.append(task)
        return task

    def get(self, task_id: int) -> PrepareTask | None:
        return self._tasks.get(task_id)

    def split(self, task: PrepareTask) -> list[PrepareTask]:
        """Replace a queued task by one task per position (to find which record kills workers);
        the new tasks keep its death count."""
        assert task.worker_id is None, f"task {task.task_id} is in flight"
        self._queue.remove(task)
        del self._tasks[task.task_id]
        out = [self.new(task.source, task.positions[i: i + 1], task.deaths) for i in range(len(task.positions))]
        for t in out:
            t.workers = list(task.workers)
        return out

    def drop(self, task: PrepareTask) -> None:
        """A queued task that needs no worker (its records were settled without one)."""
        assert task.worker_id is None, f"task {task.task_id} is in flight"
        self._tasks.pop(task.task_id, None)

    def withdraw(self, worker_id: int) -> list[PrepareTask]:
        """The worker is gone: its tasks go back to the queue, in task order."""
        out = [self._tasks[tid] for tid in sorted(self._by_worker.get(worker_id, ()))]
        for task in out:
            self._unassign(task)
            self._queue.append(task)
        return out

    def backlog_s(self, worker_id: int) -> float:
        """Estimated seconds of the tasks in flight on the worker."""
        return self._backlog.get(worker_id, 0.0)

    def in_flight(self, worker_id: int) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def floors(self, n_sources: int) -> list[int | None]:
        """Per source, the lowest stream position any task still refers to (None: none)."""
        out: list[int | None] = [None] * n_sources
        for t in self._tasks.values():
            if len(t.positions):
                low = int(t.positions.min())
                out[t.source] = low if out[t.source] is None else min(out[t.source], low)
        return out

    def clear(self) -> None:
        """Forget every task (the plan was rewound: what they prepare is not needed as asked)."""
        self._tasks.clear()
        self._queue.clear()
        self._by_worker.clear()
        self._backlog.clear()
