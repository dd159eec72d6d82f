"""`msd demo`: the embedded job end to end on loopback, with a progress bar and a summary.

Starts a coordinator, a worker host with W worker processes and R trainer processes (each a
DataClient). Trainers report per-step figures through a queue; the summary compares the
planner's per-rank attention cost with the same documents dealt in arrival order.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from collections import defaultdict
from typing import Any

import numpy as np
import orjson
import yaml

from msd_common.doc_keys import split_doc_key
from msd_common.formats.jsonl import default_cache_dir

from .demo_data import DEMO_JOB, ensure_demo_data
from .local import LocalJob

_SPAWN = mp.get_context("spawn")


def _trainer(address: str, rank: int, steps: int, quadratic: float, linear: float, out: Any) -> None:
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=False, timeout_s=120)
    try:
        per_step: dict[str, Any] = {}
        for batch in client:
            lengths = batch["piece_lengths"].astype(np.float64)
            sources = split_doc_key(batch["doc_keys"])[0].astype(np.int64)
            if batch["micro_batch"] == 0:
                per_step = {"step": batch["step"], "rank": rank, "tokens": 0, "cost": 0.0,
                            "source_tokens": defaultdict(int), "plan": batch["plan"], "t": 0.0}
            per_step["tokens"] += batch["num_tokens"]
            per_step["cost"] += float(np.sum(quadratic * lengths**2 + linear * lengths))
            for s, n in zip(sources.tolist(), lengths.tolist()):
                per_step["source_tokens"][s] += int(n)
            if batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
                per_step["t"] = time.monotonic()
                per_step["source_tokens"] = dict(per_step["source_tokens"])
                out.put(per_step)
                if batch["step"] + 1 >= steps:
                    break
    except Exception as e:
        out.put({"error": f"rank {rank}: {type(e).__name__}: {e}"})
    finally:
        client.close()


def _write_job(data_dir: str, ranks: int) -> str:
    job = yaml.safe_load(DEMO_JOB)
    job["topology"]["dp"] = ranks
    job["batch"]["global_batch_size"] = 4 * ranks
    path = os.path.join(data_dir, f"demo-r{ranks}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def run_demo(steps: int, ranks: int, workers: int, json_path: str | None = None, data_dir: str | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from msd_common.spec import load_job

    console = Console(stderr=True)
    data_dir = data_dir or os.path.join(default_cache_dir(), "demo")
    started = time.monotonic()
    with console.status("preparing the demo dataset (first run only)..."):
        ensure_demo_data(data_dir)
    job_path = _write_job(data_dir, ranks)
    job = load_job(job_path)
    names = [s.name for s in job.sources]
    results: dict[int, dict[int, dict]] = defaultdict(dict)
    errors: list[str] = []
    with LocalJob(job_path, workers=workers) as cluster:
        out = _SPAWN.Queue()
        trainers = [
            _SPAWN.Process(target=_trainer, args=(cluster.address, r, steps, job.cost.quadratic, job.cost.linear, out))
            for r in range(ranks)
        ]
        for t in trainers:
            t.start()
        with Progress(console=console, transient=False) as progress:
            bar = progress.add_task(f"{ranks} ranks x {steps} steps", total=steps * ranks)
            while len([1 for r in results.values() for _ in r]) < steps * ranks and not errors:
                try:
                    item = out.get(timeout=1.0)
                except queue.Empty:
                    if not any(t.is_alive() for t in trainers):
                        errors.append("all trainer processes exited early")
                    continue
                if "error" in item:
                    errors.append(item["error"])
                    continue
                results[item["step"]][item["rank"]] = item
                progress.advance(bar)
        for t in trainers:
            t.join(timeout=30)
    if errors:
        for e in errors:
            console.print(f"[red]error:[/red] {e}")
        return 1
    summary = summarize(results, names, job.weights, ranks, workers, time.monotonic() - started)
    table = Table(title="megascale-data demo")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key in ("steps", "ranks", "workers", "tokens", "tokens_per_s", "imbalance", "naive_imbalance", "wall_s"):
        v = summary[key]
        table.add_row(key, f"{v:,.3f}" if isinstance(v, float) else f"{v:,}")
    for name, m in summary["mixture"].items():
        table.add_row(f"mixture {name}", f"target {m['target']:.3f}  actual {m['actual']:.3f}")
    Console().print(table)
    print(next_steps(job_path, ranks, workers), flush=True)  # plain: rich would wrap the long lines
    if json_path:
        with open(json_path, "wb") as f:
            f.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2))
    return 0


def next_steps(job_path: str, ranks: int, workers: int) -> str:
    """The commands that run the same job by hand, one process at a time (printed after the demo)."""
    train = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools",
                         "train_tiny.py")
    msd = os.path.join(os.path.dirname(sys.executable), "msd")  # this environment's, activated or not
    return "\n".join([
        "",
        f"The demo's job file is {job_path}. To run it by hand, in three terminals:",
        f"  {msd} coordinator --config {job_path} --bind tcp://127.0.0.1:5555 --state-dir /tmp/msd-demo-state",
        f"  {msd} worker --coordinator tcp://127.0.0.1:5555 --procs {workers}",
        f"  {sys.executable} {train} --coordinator tcp://127.0.0.1:5555 --world-size {ranks} --steps 50"
        "   # DDP trainer ranks (needs torch)",
        f"(or the first two as one: {msd} coordinator ... --worker-procs {workers})",
    ])


def summarize(results: dict[int, dict[int, dict]], names: list[str], weights: dict[str, float], ranks: int,
              workers: int, wall_s: float) -> dict[str, Any]:
    steps = sorted(results)
    tokens = sum(r["tokens"] for s in steps for r in results[s].values())
    imbalances, naive = [], []
    source_tokens = defaultdict(int)
    for s in steps:
        costs = [results[s][r]["cost"] for r in range(ranks)]
        imbalances.append(max(costs) / (sum(costs) / ranks) if sum(costs) else 1.0)
        naive.append(results[s][0]["plan"]["naive_max_over_mean"])
        for r in results[s].values():
            for src, n in r["source_tokens"].items():
                source_tokens[int(src)] += n
    times = [r["t"] for s in steps for r in results[s].values()]
    first_step = [r["t"] for r in results[steps[0]].values()]
    # Throughput from the first completed step to the last: start-up (dataset, processes) excluded.
    span = max(times) - max(first_step)
    measured_tokens = sum(r["tokens"] for s in steps[1:] for r in results[s].values())
    total = sum(source_tokens.values()) or 1
    return {
        "steps": len(steps),
        "ranks": ranks,
        "workers": workers,
        "tokens": int(tokens),
        "tokens_per_s": float(measured_tokens / span) if span > 0 else 0.0,
        "imbalance": float(np.mean(imbalances)),
        "naive_imbalance": float(np.mean(naive)),
        "wall_s": float(wall_s),
        "mixture": {n: {"target": weights[n], "actual": source_tokens[i] / total} for i, n in enumerate(names)},
    }
