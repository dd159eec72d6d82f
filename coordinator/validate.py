"""Do the coordinator's books agree with each other? (after Dask's `validate_state`)

`validate_state(state)` returns what disagrees, as sentences (empty: all agree). Nothing here
changes the state. The simulation (`msd.sim`) calls it after every event; it is O(positions
held), too slow for the serving path.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .deliveries import DeliveryState

if TYPE_CHECKING:
    from .state import CoordinatorState


def validate_state(state: "CoordinatorState") -> list[str]:
    problems: list[str] = []
    workers = state.registry.workers
    problems += _tasks(state, workers)
    problems += _deliveries(state, workers)
    problems += _holders(state, workers)
    problems += _registry(state)
    problems += _eval_sets(state, workers)
    plan = state.planner.state.next_step
    for rank, trainer in state.registry.trainers.items():
        if trainer.consumed >= max(plan, state.planned_until):
            problems.append(f"rank {rank} consumed step {trainer.consumed}, which was never planned "
                            f"(the plan stands at {plan})")
    return problems


def _tasks(state: "CoordinatorState", workers: dict) -> list[str]:
    out = []
    book = state.tasks
    for task in book._tasks.values():
        if task.worker_id is None:
            continue
        if task.worker_id not in workers:
            out.append(f"prepare task {task.task_id} is assigned to worker {task.worker_id}, which is not registered")
        if task.task_id not in book._by_worker.get(task.worker_id, ()):
            out.append(f"prepare task {task.task_id} of worker {task.worker_id} is missing from its worker's tasks")
    for wid, ids in book._by_worker.items():
        for tid in ids:
            task = book._tasks.get(tid)
            if task is None or task.worker_id != wid:
                out.append(f"worker {wid} is said to hold prepare task {tid}, which is "
                           f"{'gone' if task is None else f'assigned to {task.worker_id}'}")
    queued = set()
    for task in book._queue:
        queued.add(task.task_id)
        if task.worker_id is not None:
            out.append(f"prepare task {task.task_id} is queued and assigned to worker {task.worker_id}")
        if book._tasks.get(task.task_id) is not task:
            out.append(f"prepare task {task.task_id} is queued but not in the book")
    for task in book._tasks.values():
        if task.worker_id is None and task.task_id not in queued:
            out.append(f"prepare task {task.task_id} is neither queued nor assigned: nobody will prepare it")
    for wid, ids in book._by_worker.items():
        if not ids:
            out.append(f"worker {wid} has an empty set of prepare tasks (it should have none)")
        want = sum(book._tasks[t].estimate_s for t in ids if t in book._tasks)
        if abs(book._backlog.get(wid, 0.0) - want) > 1e-6 * max(1.0, want):
            out.append(f"worker {wid}'s backlog is {book._backlog.get(wid, 0.0):.6f} s, its tasks' estimates sum "
                       f"to {want:.6f} s")
    for wid in book._backlog.keys() - book._by_worker.keys():
        out.append(f"worker {wid} has a backlog and no prepare task")
    return out


def _eval_sets(state: "CoordinatorState", workers: dict) -> list[str]:
    out = []
    book = state.eval
    for e in book.sets:
        for wid in np.unique(e.holder[e.holder >= 0]).tolist():
            if wid not in workers:
                out.append(f"eval set {e.cfg.name}: worker {wid} is said to hold records, and is not registered")
    for task in book.tasks.values():
        if task.worker_id not in workers:
            out.append(f"eval task {task.task_id} is on worker {task.worker_id}, which is not registered")
    return out


def _deliveries(state: "CoordinatorState", workers: dict) -> list[str]:
    out = []
    book = state.deliveries
    for d in book._live.values():
        if d.state is DeliveryState.ORPHANED:
            continue
        if d.worker_id not in workers:
            out.append(f"delivery {d.delivery_id} (step {d.step}) waits on worker {d.worker_id}, which is not "
                       "registered")
        elif d.delivery_id not in book._by_worker.get(d.worker_id, ()):
            out.append(f"delivery {d.delivery_id} is missing from worker {d.worker_id}'s deliveries")
    for wid, ids in book._by_worker.items():
        for did in ids:
            d = book._live.get(did)
            if d is None or d.worker_id != wid:
                out.append(f"worker {wid} is said to hold delivery {did}, which is "
                           f"{'gone' if d is None else f'of worker {d.worker_id}'}")
    orphaned = sum(d.state is DeliveryState.ORPHANED for d in book._live.values())
    if orphaned != book.orphaned:
        out.append(f"{orphaned} deliveries are orphaned, the book counts {book.orphaned}")
    return out


def _holders(state: "CoordinatorState", workers: dict) -> list[str]:
    """Every prepared copy is held by a registered worker; the counts of memory-mapped copies
    each worker holds agree with the tables."""
    out = []
    prep = state.prep
    n = state.registry.next_worker_id + 1
    mapped = np.zeros(n, dtype=np.int64)
    for s, table in enumerate(state.tables):
        holders = table._live("holder")
        held = holders[holders >= 0]
        unknown = sorted(set(np.unique(held).tolist()) - set(workers))
        if unknown:
            out.append(f"source {s}: prepared copies are held by workers {unknown[:5]}, which are not registered")
        if s in state.mapped and held.size:
            mapped += np.bincount(held, minlength=n)[:n]
    counted = prep.mapped_held.counts(n)
    if not np.array_equal(mapped, counted):
        wrong = np.flatnonzero(mapped != counted)[:5].tolist()
        out.append(f"memory-mapped copies held per worker disagree with the tables for workers {wrong}")
    return out


def _registry(state: "CoordinatorState") -> list[str]:
    out = []
    reg = state.registry
    books = {"worker": reg.workers, "trainer": reg.trainers, "host": reg.hosts, "relay": reg.relays}
    for identity, (role, pid) in reg._roles.items():
        if pid not in books[role]:
            out.append(f"peer {identity!r} is a {role} {pid}, which is not registered")
    for role, book in books.items():  # and the other way: every registered peer is known by its identity
        for pid, info in book.items():
            if reg._roles.get(info.identity) != (role, pid):
                out.append(f"{role} {pid} is registered, but its identity {info.identity!r} is "
                           f"{reg._roles.get(info.identity) or 'unknown'}")
    return out
