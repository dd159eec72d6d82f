"""The coordinator's Prometheus metrics (`msd coordinator --metrics-port PORT`), with
prometheus-client on a registry of their own.

The state machine stays free of them: the shell (`app.py`) counts the messages it receives and
sends and times its file work, takes each step's plan summary from the step headers it sends,
and copies the state's counters (steps, ranks, peers, skips) into gauges once per heartbeat.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

RATIO_BUCKETS = (1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)


class CoordinatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.received = Counter("msd_messages_received", "Messages the coordinator received, by type", ["type"],
                                registry=r)
        self.dropped = Counter("msd_messages_dropped", "Messages dropped as malformed or not allowed", registry=r)
        self.sent = Counter("msd_messages_sent", "Messages the coordinator sent, by type", ["type"], registry=r)
        self.steps_planned = Gauge("msd_steps_planned", "Steps planned so far (the plan's next step)", registry=r)
        self.steps_consumed = Gauge("msd_steps_consumed", "The last step each rank consumed", ["rank"], registry=r)
        self.data_wait = Gauge("msd_rank_data_wait_seconds", "Seconds each rank waited for data (its client's report)",
                               ["rank"], registry=r)
        self.workers = Gauge("msd_workers_alive", "Worker processes registered", registry=r)
        self.hosts = Gauge("msd_worker_hosts_alive", "Worker host agents registered", registry=r)
        self.skipped = Gauge("msd_skipped_records", "Records skipped, by source and kind (corrupt, over_limit, error, "
                             "quarantined)", ["source", "kind"], registry=r)
        self.source_tokens = Counter("msd_source_tokens_planned", "Tokens planned per source", ["source"], registry=r)
        self.target_share = Gauge("msd_mixture_target_share", "The mixture's weight of each source at the plan's step",
                                  ["source"], registry=r)
        self.rank_cost = Histogram("msd_step_rank_cost_max_over_mean", "Max over mean attention cost of a step's ranks",
                                   buckets=RATIO_BUCKETS, registry=r)
        self.naive_cost = Histogram("msd_step_naive_rank_cost_max_over_mean", "The same for the step's documents "
                                    "dealt in arrival order", buckets=RATIO_BUCKETS, registry=r)
        self.planning = Histogram("msd_planning_seconds", "Coordinator time per planned step (handling and planning)",
                                  buckets=SECONDS_BUCKETS, registry=r)
        self.journal = Histogram("msd_journal_write_seconds", "Time of one state dir write", ["kind"],
                                 buckets=SECONDS_BUCKETS, registry=r)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics over HTTP (a thread of prometheus-client's)."""
        start_http_server(port, addr=host, registry=self.registry)

    def planned(self, headers: list[dict[str, Any]], seconds: float) -> None:
        """The step headers one handle() call sent: each step's plan summary once, and the call's
        time spread over its steps."""
        seen: set[int] = set()
        for h in headers:
            if h["step"] in seen:
                continue
            seen.add(h["step"])
            plan = h["plan"]
            self.rank_cost.observe(plan["max_over_mean"])
            self.naive_cost.observe(plan["naive_max_over_mean"])
            for source, tokens in plan["source_tokens"].items():
                self.source_tokens.labels(source).inc(tokens)
        for _ in seen:
            self.planning.observe(seconds / len(seen))

    def update(self, state: Any) -> None:
        """Copy the state's counters (once per heartbeat)."""
        reg = state.registry
        self.steps_planned.set(state.planner.state.next_step)
        for rank, t in reg.trainers.items():
            self.steps_consumed.labels(str(rank)).set(t.consumed)
            self.data_wait.labels(str(rank)).set(t.waited_s)
        self.workers.set(len(reg.workers))
        self.hosts.set(len(reg.hosts))
        weights = state.planner.weights_at(state.planner.state.next_step)
        for source in state.job.sources:
            self.target_share.labels(source.name).set(weights[source.index])
            for kind, n in state.skipped_by_kind[source.index].items():
                self.skipped.labels(source.name, kind).set(n)
