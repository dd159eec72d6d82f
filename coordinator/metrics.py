"""The coordinator's Prometheus metrics (`msd coordinator --metrics-port PORT`), with
prometheus-client on a registry of their own.

The state machine stays free of them: the shell (`app.py`) counts the messages it receives and
sends and times its file work, takes each step's plan summary from the step headers it sends,
and copies the state's counters (steps, ranks, peers, skips) once per heartbeat. Totals the state
keeps (skips, data wait, tokens delivered, re-prepares) are served as counters from that copy by a
collector: the HTTP thread never reads the state itself.
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from msd_common import health
from .state_status import data_wait, target_so_far_share
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

RATIO_BUCKETS = (1.0, 1.01, 1.02, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0)
SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 5.0)


# the relays' series (one per trainer host with `msd relay`): status key, kind, name, help
RELAY_SERIES = (
    ("ranks", "gauge", "msd_relay_ranks", "Ranks a relay speaks for"),
    ("bytes_in", "counter", "msd_relay_bytes_in", "Bytes of pieces a relay took from the workers"),
    ("bytes_out", "counter", "msd_relay_bytes_out", "Bytes of pieces a relay passed to its ranks (a piece its "
     "host's ranks share counts once in, once per rank out)"),
    ("queued", "gauge", "msd_relay_queued", "Piece messages waiting for a local rank's socket"),
    ("late_steps", "counter", "msd_relay_late_steps", "Steps whose consumed reports a relay sent up without every "
     "local rank's (one was late)"),
)


class _Totals(Collector):
    """Counters and per-rank and per-source gauges whose values the state keeps, from the copy
    taken on the event loop (a plain dict per heartbeat: setting a Gauge child per rank and per
    source took a lock each, thousands per heartbeat at hundreds of ranks and sources)."""

    def __init__(self) -> None:
        self.copy: dict[str, Any] = {"skipped": {}, "wait": {}, "delivered": {}, "reprepared": 0, "consumed": {},
                                     "target": {}, "target_so_far": {}, "realised": {}, "eval_loss": {},
                                     "long_docs": {}, "cost": {}, "train_loss": {},
                                     "relays": []}

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        c = self.copy  # replaced whole on the loop thread: a consistent snapshot
        for name, doc, label, key in (
                ("msd_steps_consumed", "The last step each rank consumed", "rank", "consumed"),
                ("msd_mixture_target_share", "The mixture's weight of each source at the plan's step", "source",
                 "target"),
                ("msd_mixture_realised_share", "Each source's share of every token planned so far", "source",
                 "realised"),
                ("msd_mixture_target_so_far_share", "Each source's share of every token planned so far as the "
                 "mixture asked for it (its changes and ramps included): compare msd_mixture_realised_share with it",
                 "source", "target_so_far")):
            gauge = GaugeMetricFamily(name, doc, labels=[label])
            for value_label, value in c[key].items():
                gauge.add_metric([value_label], value)
            yield gauge
        skipped = CounterMetricFamily("msd_skipped_records", "Records skipped, by source and kind (corrupt, "
                                      "over_limit, error, quarantined, transform_error, skipped, "
                                      "no_trainable_tokens)", labels=["source", "kind"])
        for (source, kind), n in c["skipped"].items():
            skipped.add_metric([source, kind], n)
        wait = CounterMetricFamily("msd_rank_data_wait_seconds", "Seconds each rank waited for data (its client's "
                                   "report)", labels=["rank"])
        for rank, seconds in c["wait"].items():
            wait.add_metric([rank], seconds)
        delivered = CounterMetricFamily("msd_source_tokens_delivered", "Tokens per source in steps every rank "
                                        "consumed", labels=["source"])
        for source, tokens in c["delivered"].items():
            delivered.add_metric([source], tokens)
        reprepared = CounterMetricFamily("msd_records_reprepared", "Records prepared again (lost with a dead "
                                         "worker)")
        reprepared.add_metric([], c["reprepared"])
        eval_loss = GaugeMetricFamily("msd_eval_loss", "The last mean loss per source of each eval set (the trainers' "
                                      "report_eval)", labels=["set", "source"])
        for (name, source), loss in c["eval_loss"].items():
            eval_loss.add_metric([name, source], loss)
        train_loss = GaugeMetricFamily("msd_train_loss", "The trainers' mean training loss per source over the last "
                                       "mixture.adapt window (DataClient.report_loss), which its policy decided on",
                                       labels=["source"])
        for source, loss in c["train_loss"].items():
            train_loss.add_metric([source], loss)
        long_docs = CounterMetricFamily("msd_long_documents", "Records longer than seq_len, truncated or dropped "
                                        "(long_docs), by source", labels=["source", "kind"])
        for (source, kind), n in c["long_docs"].items():
            long_docs.add_metric([source, kind], n)
        coefficient = GaugeMetricFamily("msd_cost_coefficient", "The cost model planning now, by term (seconds per "
                                        "unit once calibrated; balance.calibrate)", labels=["term"])
        for term, value in (c["cost"].get("coefficients") or {}).items():
            coefficient.add_metric([term], value)
        fit_error = GaugeMetricFamily("msd_cost_fit_error", "Relative error of the last fit of the cost model to the "
                                      "trainers' compute times, and of the model planning now", labels=["model"])
        if c["cost"].get("fit"):
            fit_error.add_metric(["fit"], c["cost"]["fit"]["error"])
        if c["cost"].get("model_error") is not None:
            fit_error.add_metric(["current"], c["cost"]["model_error"])
        relay_families = {key: (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(
            name, doc, labels=["host", "relay"]) for key, kind, name, doc in RELAY_SERIES}
        for r in c["relays"]:
            for key, family in relay_families.items():
                family.add_metric([r["host"], str(r["relay_id"])], len(r["ranks"]) if key == "ranks" else r[key])
        yield from (skipped, wait, delivered, reprepared, eval_loss, train_loss, long_docs, coefficient, fit_error,
                    *relay_families.values())


class CoordinatorMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.received = Counter("msd_messages_received", "Messages the coordinator received, by type", ["type"],
                                registry=r)
        self.dropped = Counter("msd_messages_dropped", "Messages dropped as malformed or not allowed", registry=r)
        self.sent = Counter("msd_messages_sent", "Messages the coordinator sent, by type", ["type"], registry=r)
        self.steps_planned = Gauge("msd_steps_planned", "Steps planned so far (the plan's next step)", registry=r)
        self.steps_journaled = Gauge("msd_steps_journaled", "Steps whose plan is durable in the state dir's journal",
                                     registry=r)
        self.workers = Gauge("msd_workers_alive", "Worker processes registered", registry=r)
        self.hosts = Gauge("msd_worker_hosts_alive", "Worker host agents registered", registry=r)
        self.source_tokens = Counter("msd_source_tokens_planned", "Tokens planned per source", ["source"], registry=r)
        self.rank_cost = Histogram("msd_step_rank_cost_max_over_mean", "Max over mean attention cost of a step's ranks",
                                   buckets=RATIO_BUCKETS, registry=r)
        self.naive_cost = Histogram("msd_step_naive_rank_cost_max_over_mean", "The same for the step's documents "
                                    "dealt in arrival order", buckets=RATIO_BUCKETS, registry=r)
        self.planning = Histogram("msd_planning_seconds", "Coordinator time per planned step (handling and planning)",
                                  buckets=SECONDS_BUCKETS, registry=r)
        self.journal = Histogram("msd_journal_write_seconds", "Time of one state dir write", ["kind"],
                                 buckets=SECONDS_BUCKETS, registry=r)
        self.workers_wanted = Gauge(
            "msd_workers_wanted", "Worker processes the job wants: those the hosts run now (less those being "
            "retired) plus the shortfall while every host is at its limit and trainers wait. An autoscaler of "
            "worker hosts divides it by the processes one host runs (deploy/helm/msd: a HorizontalPodAutoscaler)",
            registry=r)
        self.health = health.Health()
        self.totals = _Totals()
        r.register(self.totals)
        self._pending: dict[int, dict[str, int]] = {}  # step -> tokens per source, until every rank consumed it
        self._delivered: dict[str, int] = {}
        self._message_counts: dict[tuple[Counter, str], int] = {}
        self._children: dict[tuple[Any, str], Any] = {}

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        """Serve /metrics, /healthz and /readyz over HTTP (msd_common.health, a thread)."""
        health.serve(port, host, self.health, self.registry)

    def planned(self, steps: list[tuple[int, float, float, list[int]]], names: list[str], seconds: float) -> None:
        """The steps one handle() call planned ((step, max/mean, arrival-order max/mean, tokens per
        source), `CoordinatorState.planned`), and the call's time spread over them."""
        for step, ours, naive, tokens in steps:
            self.rank_cost.observe(ours)
            self.naive_cost.observe(naive)
            per_source = {}
            for name, n in zip(names, tokens):
                if n:
                    self._child(self.source_tokens, name).inc(n)
                    per_source[name] = n
            self._pending.setdefault(step, per_source)
            self.planning.observe(seconds / len(steps))

    def _child(self, metric: Any, label: str) -> Any:
        """A metric's child for one label value, looked up once: prometheus-client's labels() costs
        about 10 us, and every source's and rank's gauges are set at each update."""
        key = (metric, label)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(label)
        return child

    def message(self, counter: Counter, kind: str) -> None:
        """Count one message of `kind`: a dict increment here, added to the Prometheus counter at
        the next update (at a thousand ranks, the counter's lock and child lookup per message cost
        a noticeable share of the coordinator's CPU)."""
        key = (counter, kind)
        self._message_counts[key] = self._message_counts.get(key, 0) + 1

    def _flush_messages(self) -> None:
        for (counter, kind), n in self._message_counts.items():
            self._child(counter, kind).inc(n)
        self._message_counts.clear()

    def update(self, state: Any, journaled_step: int | None = None) -> None:
        """Copy the state's counters (once per heartbeat, on the event loop)."""
        reg = state.registry
        self._flush_messages()
        self.steps_planned.set(state.planner.state.next_step)
        if journaled_step is not None:
            self.steps_journaled.set(journaled_step + 1)
        if reg.trainers:
            floor = reg.slowest()
            for step in [s for s in self._pending if s <= floor]:
                for source, tokens in self._pending.pop(step).items():
                    self._delivered[source] = self._delivered.get(source, 0) + tokens
        self.health.beat()
        self.health.set("active", True)
        self.workers.set(len(reg.workers))
        self.hosts.set(len(reg.hosts))
        self.workers_wanted.set(sum(h.procs - len(h.retiring) for h in reg.hosts.values()) + state.workforce.needed)
        weights = state.planner.weights_at(state.planner.state.next_step)
        delivered = state.planner.state.delivered
        total = sum(delivered) or 1
        skipped = {}
        for source in state.job.sources:
            for kind, n in state.skipped_by_kind[source.index].items():
                skipped[(source.name, kind)] = n
        names = [source.name for source in state.job.sources]
        self.totals.copy = {"skipped": skipped, "wait": {str(r): w for r, w in data_wait(state).items()},
                            "delivered": dict(self._delivered), "reprepared": state.prep.reprepared,
                            "consumed": {str(r): t.consumed for r, t in reg.trainers.items()},
                            "target": dict(zip(names, weights)),
                            "realised": {name: n / total for name, n in zip(names, delivered)},
                            "target_so_far": target_so_far_share(state),
                            "eval_loss": {(name, source): loss for name, by_source in state.eval.losses.items()
                                          for source, (_, loss) in by_source.items()},
                            "long_docs": {(src.name, kind): n for src in state.job.sources
                                          for kind, n in state.prep.long_docs[src.index].items()},
                            "cost": state.calibration.status(state.planner.state.next_step),
                            "train_loss": {source: loss for source, loss in (state.adapt.status()["last_loss"] if
                                                                              state.adapt is not None else {}).items()
                                           if loss is not None},
                            "relays": state.relay_status()}
