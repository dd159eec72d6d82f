"""Worker capacity: what each source costs to prepare, which worker gets the next prepare task,
and how many worker processes each host should run.

Cost: every `prepared` reply says how long the worker spent on the task; per source we keep a
moving estimate of seconds per record and per token (exponentially weighted, so a source whose
cost drifts is followed).

Allocation ("adaptive", the default): any worker serves any source, and a task goes to the
worker with the least estimated work queued (the sum of its tasks' estimated seconds). Expensive
sources thereby take as many workers as their demand (their mixture weight times the trainers'
consumption) times their cost calls for, and no worker idles while another source is behind.
"fixed" splits the workers equally among the sources with weight, each serving one source only:
the per-source loader design, kept to measure the difference (tools/bench_autoscale.py).

Scaling: hosts started with `--procs auto` are grown by one process while the trainers wait for
data and the workers are busy, and shrunk by one when the workers are mostly idle. A shrink first
stops giving work to one of the host's workers, and names it to its agent only once it holds no
prepared record, no task and no delivery, so nothing has to be prepared again. When every host
is at its limit and the trainers still wait, the job's shortfall is estimated and logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .registry import HostInfo

log = logging.getLogger("msd.coordinator")

EWMA = 0.2  # weight of the newest measurement in the moving cost estimates
DECIDE_EVERY_S = 2.0  # scaling decisions look at this much history
GROW_WAIT_SHARE = 0.05  # trainers waiting more than this share of the time for data...
GROW_BUSY = 0.5  # ...while workers are busy at least this share: one more process
SHRINK_BUSY = 0.25  # workers busy less than this share...
REPORT_EVERY_S = 30.0
WAIT_CAP = 0.9  # the shortfall estimate: at most 9x the workers there are


@dataclass
class SourceCost:
    s_per_record: float | None = None
    s_per_token: float | None = None
    records: int = 0
    busy_s: float = 0.0

    def update(self, seconds: float, records: int, tokens: int) -> None:
        self.records += records
        self.busy_s += seconds
        if records <= 0:
            return
        per_record, per_token = seconds / records, seconds / max(tokens, 1)
        if self.s_per_record is None:
            self.s_per_record, self.s_per_token = per_record, per_token
        else:
            self.s_per_record += EWMA * (per_record - self.s_per_record)
            self.s_per_token += EWMA * (per_token - self.s_per_token)


class Workforce:
    def __init__(self, n_sources: int, allocation: str, shrink_after_s: float = 10.0) -> None:
        self.allocation = allocation
        self.shrink_after_s = shrink_after_s  # workers idle this long (trainers not waiting): one process fewer
        self.costs = [SourceCost() for _ in range(n_sources)]
        self.needed = 0  # more processes the job needs (0: enough, or not every host is at its limit)
        self._window_start: float | None = None
        self._busy_at_start: dict[int, float] = {}
        self._waited_at_start: dict[int, float] = {}
        self._idle_since: float | None = None
        self._last_report = 0.0
        self.last_busy = 0.0  # workers' busy share over the last decision window
        self.last_wait = 0.0  # the most-waiting rank's share of time waiting for data, same window
        self.steps_per_s = 0.0  # the slowest rank's consumption, same window
        self._consumed_at_start: int | None = None

    # ------------------------------------------------------------------ cost

    def estimate(self, source: int, records: int) -> float:
        """Seconds a task of `records` records of `source` is expected to take."""
        per = self.costs[source].s_per_record
        return records * (per if per is not None else 1e-4)

    def record(self, source: int, seconds: float, records: int, tokens: int) -> None:
        self.costs[source].update(seconds, records, tokens)

    # ------------------------------------------------------------------ allocation

    def choose(self, source: int, workers: list[int], weights: list[float], backlog_s: Callable[[int], float],
               held: Any = None) -> int:
        """The worker (id) for the next task of `source`, among `workers`: the one with the least
        estimated work queued (backlog_s(worker id)). `held` (indexed by worker id): records each
        worker holds, the next criterion after the backlog (records of memory-mapped sources,
        prepared by the coordinator, are no task: a worker's share of them is what it will be
        asked to deliver)."""
        candidates = workers
        if self.allocation == "fixed":
            serving = self.fixed_split(workers, weights)
            mine = [w for w in workers if serving.get(w) == source]
            candidates = mine or workers  # fewer workers than sources: someone must do it
        if held is None:
            return min(candidates, key=lambda w: (backlog_s(w), w))
        return min(candidates, key=lambda w: (backlog_s(w), int(held[w]), w))

    @staticmethod
    def fixed_split(worker_ids: Iterable[int], weights: list[float]) -> dict[int, int]:
        """worker id -> the one source it serves: the sources with weight dealt round-robin."""
        active = [s for s, w in enumerate(weights) if w > 0] or list(range(len(weights)))
        return {wid: active[i % len(active)] for i, wid in enumerate(sorted(worker_ids))}

    # ------------------------------------------------------------------ scaling

    def decide(self, now: float, hosts: dict[int, HostInfo], workers: dict[int, Any],
               trainers: dict[int, Any]) -> list[tuple[HostInfo, int]]:
        """Every DECIDE_EVERY_S: (host, new process count) to grow; also starts retiring workers
        of over-provisioned auto hosts. Workers have busy_s and agent; trainers have waited_s."""
        if self._window_start is None:
            self._reset_window(now, workers, trainers)
            return []
        span = now - self._window_start
        if span < DECIDE_EVERY_S:
            return []
        busy = sum(max(0.0, w.busy_s - self._busy_at_start.get(wid, 0.0)) for wid, w in workers.items())
        self.last_busy = busy / (span * len(workers)) if workers else 0.0
        waits = [max(0.0, t.waited_s - self._waited_at_start.get(r, t.waited_s)) for r, t in trainers.items()]
        # at most all of the time: a `consumed` report carries waits from before the window too
        self.last_wait = min(1.0, max(waits) / span) if waits else 0.0
        consumed = min((t.consumed for t in trainers.values()), default=None)
        if consumed is not None and self._consumed_at_start is not None:
            self.steps_per_s = max(0, consumed - self._consumed_at_start) / span
        self._reset_window(now, workers, trainers)
        out: list[tuple[HostInfo, int]] = []
        auto_hosts = [h for h in hosts.values() if h.auto]
        if self.last_wait > GROW_WAIT_SHARE and self.last_busy > GROW_BUSY:
            self._idle_since = None
            room = [h for h in auto_hosts if h.procs < h.max_procs]
            if room:
                h = max(room, key=lambda h: (h.max_procs - h.procs, -h.agent_id))
                out.append((h, h.procs + 1))
                self.needed = 0
            elif hosts and all(h.procs >= h.max_procs for h in hosts.values()):
                # Waiting w of the time means the workers deliver (1 - w) of what is asked for. A
                # trainer that waits nearly always (one that does nothing but read) asks for without
                # bound; the estimate stops at WAIT_CAP.
                n, w = len(workers), min(self.last_wait, WAIT_CAP)
                self.needed = max(1, math.ceil(n * w / (1 - w) - 1e-9))  # (0.9 / 0.1 is 9.000000000000002)
                if now - self._last_report > REPORT_EVERY_S:
                    self._last_report = now
                    log.warning("trainers wait %.0f%% of the time for data and every worker host is at its "
                                "limit (%d processes, %.0f%% busy): the job needs about %d more worker process(es)",
                                100 * self.last_wait, n, 100 * self.last_busy, self.needed)
        elif self.last_busy < SHRINK_BUSY and self.last_wait < GROW_WAIT_SHARE / 2:
            self.needed = 0
            self._idle_since = self._idle_since if self._idle_since is not None else now
            if now - self._idle_since >= self.shrink_after_s:
                self._idle_since = now
                shrinkable = [h for h in auto_hosts if h.procs - len(h.retiring) > h.min_procs]
                if shrinkable:
                    h = max(shrinkable, key=lambda h: (h.procs, -h.agent_id))
                    mine = [w for w in workers.values() if w.agent == h.agent_id and w.worker_id not in h.retiring]
                    if mine:
                        victim = max(mine, key=lambda w: w.worker_id)  # the newest
                        h.retiring.add(victim.worker_id)
                        log.info("host %s: workers %.0f%% busy; retiring worker %d", h.host, 100 * self.last_busy,
                                 victim.worker_id)
        else:
            self._idle_since = None
        return out

    def _reset_window(self, now: float, workers: dict[int, Any], trainers: dict[int, Any]) -> None:
        self._window_start = now
        self._busy_at_start = {wid: w.busy_s for wid, w in workers.items()}
        self._waited_at_start = {r: t.waited_s for r, t in trainers.items()}
        self._consumed_at_start = min((t.consumed for t in trainers.values()), default=None)

    @staticmethod
    def retiring(hosts: dict[int, HostInfo]) -> set[int]:
        return {wid for h in hosts.values() for wid in h.retiring}

    def demand(self, weights: list[float], step_tokens: int) -> list[float]:
        """Worker processes each source keeps busy at the current consumption rate:
        weight x tokens per step x steps/s x seconds per token (demand x cost)."""
        return [w * step_tokens * self.steps_per_s * (c.s_per_token or 0.0) for w, c in zip(weights, self.costs)]

    def status(self, hosts: dict[int, HostInfo], names: list[str], weights: list[float],
               step_tokens: int) -> dict[str, Any]:
        demand = self.demand(weights, step_tokens)
        return {
            "allocation": self.allocation,
            "steps_per_s": round(self.steps_per_s, 3),
            "source_cost": {n: {"s_per_record": c.s_per_record, "s_per_token": c.s_per_token,
                                "records": c.records, "busy_s": round(c.busy_s, 3),
                                "workers_demanded": round(d, 3)}
                            for n, c, d in zip(names, self.costs, demand)},
            "hosts": {h.agent_id: {"host": h.host, "procs": h.procs, "max_procs": h.max_procs, "auto": h.auto}
                      for h in hosts.values()},
            "workers_busy": round(self.last_busy, 3),
            "trainers_waiting": round(self.last_wait, 3),
            "workers_needed": self.needed,
        }


def retire_idle(hosts: dict, workers: dict, holds: Callable[[int], bool]) -> list[tuple[Any, Any]]:
    """Workers marked for retiring (a host scaled down) that hold nothing any more: (host, worker) of
    each to stop now, taken off its host's count. One that died meanwhile is no longer retiring
    (its agent restarts it, so the count stays)."""
    out = []
    for host in hosts.values():
        for wid in sorted(host.retiring):
            w = workers.get(wid)
            if w is None:
                host.retiring.discard(wid)
            elif not holds(wid):
                host.retiring.discard(wid)
                host.procs -= 1
                log.info("worker host %s: worker %d holds nothing; stopping it (%d processes)", host.host, wid,
                         host.procs)
                out.append((host, w))
    return out
