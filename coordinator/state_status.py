"""The coordinator's status (status.json, `msd status`, the metrics): a snapshot of its books, read
from the state and changing nothing in it."""

from __future__ import annotations

import collections
import logging
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .state import CoordinatorState


def target_so_far_share(state: "CoordinatorState") -> dict[str, float]:
    """Each source's share of every token so far as the mixture asked for it (changes and ramps included)."""
    target = state.planner.state.target
    total = sum(target) or 1
    return {src.name: t / total for src, t in zip(state.job.sources, target)}


def data_wait(state: "CoordinatorState") -> dict[int, float]:
    """Seconds each rank waited for data over the run (ranks that left included)."""
    waits = dict(state.departed_wait)
    for r, t in state.registry.trainers.items():
        waits[r] = max(waits.get(r, 0.0), t.waited_s)
    return dict(sorted(waits.items()))


def relay_status(state: "CoordinatorState") -> list[dict[str, Any]]:
    """Each relay: its host, its data address, the ranks registered through it, its counters."""
    ranks: dict[int, list[int]] = {}
    for t in state.registry.trainers.values():
        if t.via is not None:
            ranks.setdefault(t.via, []).append(t.rank)
    return [{"relay_id": r.relay_id, "host": r.host, "address": r.address, "ranks": sorted(ranks.get(r.relay_id,
                                                                                                     [])),
             "bytes_in": r.bytes_in, "bytes_out": r.bytes_out, "queued": r.queued, "late_steps": r.late_steps}
            for r in state.registry.relays.values()]


def status_of(state: "CoordinatorState") -> dict[str, Any]:
    step = state.planner.state.next_step
    delivered = state.planner.state.delivered
    total = sum(delivered) or 1
    names = [s.name for s in state.job.sources]
    hosts: dict[str, list] = {}
    for w in state.registry.workers.values():
        host = state.registry.hosts.get(w.agent)
        hosts.setdefault(host.host if host else "?", []).append(
            {"worker_id": w.worker_id, "pid": w.pid, "busy_share": round(w.busy_share, 3)})
    return {
        "long_docs": {src.name: dict(state.prep.long_docs[src.index]) for src in state.job.sources
                      if state.prep.long_docs[src.index]},
        "eval": state.eval.status(),
        "cost_model": state.calibration.status(state.planner.state.next_step),
        "job": state.job.path,
        "digest": state.digest,
        "dp": state.job.dp,
        "target_share": dict(zip(names, (round(w, 6) for w in state.planner.weights_at(step)))),
        "realised_share": {n: round(d / total, 6) for n, d in zip(names, delivered)},
        # what the mixture asked of every token so far (its changes and ramps included), to
        # compare realised_share with: target_share is only the weight of the step planned now
        "target_so_far_share": {n: round(share, 6) for n, share in target_so_far_share(state).items()},
        "data_wait_s": {r: round(w, 3) for r, w in data_wait(state).items()},
        "workers_by_host": hosts,
        "events_handled": state.events_handled,
        "messages_sent": state.messages_sent,
        "next_step": step,
        "consumed": {r: t.consumed for r, t in state.registry.trainers.items()},
        "relays": relay_status(state),
        "last_consumed_step": state.last_consumed_step,
        "workers": len(state.registry.workers),
        "worker_backlog": sum(w.backlog for w in state.registry.workers.values()),
        "worker_send_waits": sum(w.send_waits for w in state.registry.workers.values()),
        "tasks_in_flight": len(state.tasks),
        "prepare_ahead_steps": dict(zip(names, (round(float(n), 2) for n in state.lead.steps_ahead()))),
        # the most bytes of images (a processor's arrays) any rank has coming, and runtime.ahead_bytes
        "ahead_bytes": {"held": state.ahead.held(), "budget": state.ahead.budget},
        # mixture.adapt: the policy, the weights it set last and the losses behind them
        **({"adapt": state.adapt.status()} if state.adapt is not None else {}),
        "step_s": None if state.lead.step_s is None else round(state.lead.step_s, 4),
        "records_reprepared": state.prep.reprepared,
        "deliveries": state.deliveries.counts(),
        "skipped": {s.name: state.skips.skipped(s.index) for s in state.job.sources},
        "skipped_by_kind": {s.name: dict(state.skipped_by_kind[s.index]) for s in state.job.sources},
        "quarantined": {state.job.sources[s].name: sorted(r) for s, r in state.quarantined.items()},
        **state.workforce.status(state.registry.hosts, [s.name for s in state.job.sources],
                                state.planner.weights_at(step), state.job.step_tokens_at(step)),
    }


class RecentWarnings(logging.Handler):
    """The last warnings and errors of this process, for `msd status`."""

    def __init__(self, keep: int = 20) -> None:
        super().__init__(logging.WARNING)
        self.recent: collections.deque[str] = collections.deque(maxlen=keep)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.recent.append(f"{time.strftime('%H:%M:%S', time.localtime(record.created))} "
                               f"{record.levelname} {record.getMessage()}")
        except Exception:  # noqa: BLE001 - a log line must never break the coordinator
            pass
