"""`msd plan JOB.yaml`: the real planner over the job's real data, with no workers and no sockets
(record lengths found in this process: msd/replay.py), to see what a job will do before it
runs: its mix, its packing, its balance against arrival-order dealing (what per-rank loaders do),
the step-time gain that the job's cost model predicts, and how many worker processes keep it fed.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from typing import Any

import numpy as np

from coordinator.balance import imbalance
from msd_common.spec import JobConfig
from coordinator.plan import SourceExhausted
from .replay import LocalLengths, fresh_plan

MEASURE_RECORDS = 256  # records read per source by --measure


def what_if(job: JobConfig, dp: int | None = None, seq_len: int | None = None) -> JobConfig:
    """The job at another data-parallel size (the same sequences per rank) or sequence length."""
    if dp is not None and dp != job.dp:
        per_rank = job.batch.global_batch_size // job.dp
        job = dataclasses.replace(job, dp=dp, topology=job.topology._replace(dp=dp),
                                  batch=dataclasses.replace(job.batch, global_batch_size=per_rank * dp))
    if seq_len is not None:
        job = dataclasses.replace(job, batch=dataclasses.replace(job.batch, seq_len=seq_len),
                                  stages=tuple(dataclasses.replace(s, seq_len=None) for s in job.stages))
    return job


def stage_starts(job: JobConfig) -> list[int]:
    starts, at = [], 0
    for stage in job.stages:
        starts.append(at)
        at = stage.until_step if stage.until_step is not None else at
    return starts


def dry_run(job: JobConfig, steps: int, every_stage: bool = True) -> dict[str, Any]:
    """Plan `steps` steps from the start of the job and, with a curriculum, from the start of every
    later stage (each a planner started at that step: the mix and the balance of a stage do not
    depend on where earlier stages left the cursors). Returns the report and the per-step series."""
    planner, known = fresh_plan(job)
    names = [s.name for s in job.sources]
    stages, series = [], []
    starts = stage_starts(job) if every_stage else [0]
    for i, start in enumerate(starts):
        planner.state.next_step = start
        planner.state.target = [0.0] * len(names)
        planner.state.delivered = [0] * len(names)
        rows = []
        started = time.perf_counter()
        for _ in range(steps):
            try:
                plan = planner.plan_step(known)
            except SourceExhausted as e:
                rows.append({"step": planner.state.next_step, "end": str(e)})
                break
            grid = planner.grid_at(plan.step)
            capacity = job.dp * grid.rows_per_rank * grid.row_capacity
            rows.append({"step": plan.step, "source_tokens": list(plan.source_tokens), "pieces": len(plan.pieces),
                         "padding_share": 1.0 - sum(plan.source_tokens) / capacity,
                         "max_over_mean": imbalance(plan.rank_costs),
                         "naive_max_over_mean": imbalance(plan.naive_rank_costs),
                         "max_cost": max(plan.rank_costs), "naive_max_cost": max(plan.naive_rank_costs),
                         "target": planner.weights_at(plan.step)})
        planned = [r for r in rows if "end" not in r]
        series.extend(planned)
        stages.append(_summary(i, start, planned, names, time.perf_counter() - started, rows[-1].get("end")))
    return {"job": job.path, "dp": job.dp, "seq_len": job.batch.seq_len, "steps_per_stage": steps,
            "cost": dataclasses.asdict(job.cost), "token_slack": job.token_slack,
            "skipped_records": {names[s]: len(k) for s, k in enumerate(known.skipped) if k},
            "eval": eval_sets(job, planner, known),
            "stages": stages, "series": series, "_known": known}


def eval_sets(job: JobConfig, planner, known) -> dict[str, Any]:
    """Each eval set as a pass would serve it: records, tokens, micro-batches per rank, and the
    max/mean rank cost of its layout (records read here, as for the planned steps)."""
    from coordinator import evaluation

    out = {}
    for cfg in job.eval_sets:
        sources, records = evaluation.set_records(job, planner.holdout, planner.num_records, cfg)
        lengths = np.zeros(len(records), np.int64)
        for s in np.unique(sources).tolist():
            mine = sources == s
            lengths[mine] = known.lengths(s, records[mine])
        layout, micro_batches = evaluation.layout(job, cfg, sources, records, lengths, job.dp)
        costs = [float((refs[:, 2].astype(np.float64) ** 2).sum() * job.cost.quadratic
                       + refs[:, 2].astype(np.float64).sum() * job.cost.linear) for refs, _, _ in layout.values()]
        out[cfg.name] = {"records": int(len(records)), "tokens": int(lengths[lengths > 0].sum()),
                         "by_source": {job.sources[s].name: int((sources == s).sum())
                                       for s in np.unique(sources).tolist()},
                         "micro_batches_per_rank": micro_batches,
                         "max_over_mean": round(max(costs) / (sum(costs) / len(costs)), 4) if sum(costs) else 1.0}
    return out


def _summary(index: int, start: int, rows: list[dict], names: list[str], seconds: float,
             end: str | None) -> dict[str, Any]:
    if not rows:
        return {"stage": index, "first_step": start, "steps": 0, "end": end}
    tokens = np.array([r["source_tokens"] for r in rows], dtype=np.float64).sum(axis=0)
    target = np.array([r["target"] for r in rows]).mean(axis=0)
    ours = sum(r["max_cost"] for r in rows)
    naive = sum(r["naive_max_cost"] for r in rows)
    out = {
        "stage": index, "first_step": start, "steps": len(rows),
        "mix": {n: {"target": float(t), "realised": float(x / tokens.sum())} for n, t, x in zip(names, target, tokens)},
        "tokens_per_step": float(tokens.sum() / len(rows)),
        "pieces_per_step": statistics.mean(r["pieces"] for r in rows),
        "padding_share": statistics.mean(r["padding_share"] for r in rows),
        "max_over_mean": statistics.mean(r["max_over_mean"] for r in rows),
        "naive_max_over_mean": statistics.mean(r["naive_max_over_mean"] for r in rows),
        # The step waits for its busiest rank. Both layouts hold the same tokens, but arrival order
        # also cuts documents wherever a row ends, which lowers their attention cost (and loses
        # context): the gain compares the busiest rank against each layout's own mean (the
        # balance), and the raw ratio of busiest-rank costs is reported beside it.
        "predicted_step_time_gain": (statistics.mean(r["naive_max_over_mean"] for r in rows)
                                     / statistics.mean(r["max_over_mean"] for r in rows)),
        "busiest_rank_cost_ratio": naive / ours if ours > 0 else 1.0,
        "planning_ms_per_step": 1000 * seconds / len(rows),
    }
    if end:
        out["end"] = end
    return out


def measure(job: JobConfig, known: LocalLengths, records: int = MEASURE_RECORDS) -> dict[str, float]:
    """Seconds of one worker process per token, per source: reading and transforming the first
    `records` records of its stream, as a worker prepares them."""
    out = {}
    for src in job.sources:
        if known.planner.streams[src.index] is None:
            continue
        reader = known.reader(src.index)
        sample = known.planner.streams[src.index].records_array(0, min(records, known.planner.num_records[src.index]))
        tokens, started = 0, time.perf_counter()
        for r in sample.tolist():
            try:
                tokens += len(reader.read_sample(r)[0])
            except Exception:  # noqa: BLE001 - a skipped record costs its try
                pass
        out[src.name] = (time.perf_counter() - started) / max(tokens, 1)
    return out


def workers_needed(report: dict[str, Any], seconds_per_token: dict[str, float], step_time_s: float) -> dict[str, Any]:
    """Worker processes that keep the ranks fed at one step per `step_time_s`, per stage: the
    seconds of work a step's tokens need (each source's tokens at its measured cost) over the step
    time. Reading only: delivery adds a little (docs/BENCHMARKS.md, the data plane)."""
    out = []
    for st in report["stages"]:
        if not st.get("steps"):
            continue
        work = sum(m["realised"] * st["tokens_per_step"] * seconds_per_token.get(name, 0.0)
                   for name, m in st["mix"].items())
        out.append({"stage": st["stage"], "worker_seconds_per_step": work,
                    "worker_processes": max(1, math.ceil(work / step_time_s))})
    return {"step_time_s": step_time_s, "seconds_per_token": seconds_per_token, "stages": out}


def plot(report: dict[str, Any], path: str) -> None:
    """Mix and balance over the planned steps, one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    names = list(report["stages"][0]["mix"]) if report["stages"] and report["stages"][0].get("mix") else []
    x = np.arange(len(series))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    shares = np.array([np.array(r["source_tokens"]) / max(sum(r["source_tokens"]), 1) for r in series])
    if len(series):
        shown = np.argsort(-shares.mean(axis=0))[:10]  # the ten largest sources by name, the rest as one
        rest = np.delete(np.arange(shares.shape[1]), shown)
        stacks = [shares[:, i] for i in shown] + ([shares[:, rest].sum(axis=1)] if len(rest) else [])
        labels = [names[i] for i in shown] + ([f"{len(rest)} others"] if len(rest) else [])
        top.stackplot(x, *stacks, labels=labels)
        top.legend(loc="upper right", fontsize=7)
    top.set_ylabel("share of step tokens")
    top.set_title(f"{report['job']}: dp={report['dp']}, seq_len={report['seq_len']}")
    bottom.plot(x, [r["naive_max_over_mean"] for r in series], label="arrival order (per-rank loaders)")
    bottom.plot(x, [r["max_over_mean"] for r in series], label="msd layout")
    bottom.set_ylabel("max / mean rank cost")
    bottom.set_xlabel("planned step (stages one after another)")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def with_calibrated_cost(job: JobConfig, state_dir: str) -> JobConfig:
    """The job with the last cost model its run calibrated (the state dir's cost journal), so the
    next job file can start from it; ValueError if the run calibrated none."""
    from msd_common.spec import CostConfig
    from coordinator.journal import read_cost_journal

    changes = read_cost_journal(state_dir)
    if not changes:
        raise ValueError(f"{state_dir}: no calibrated cost model (cost.journal is missing or empty: the run had no "
                         "balance.calibrate, or never changed its model)")
    q, lin, _, pq, pl = changes[-1][1]
    return dataclasses.replace(job, cost=CostConfig(q, lin, pq, pl))
