"""A cost model that learns the real one: `balance: {calibrate: true}` against a wrong job model.

    python tools/bench_calibrate.py [--steps 80] [--ranks 4] [--json OUT]

Ranks spend on each micro-batch the time a hidden "true" model gives (sleeping, as
tools/bench_e2e.py's ranks do): seconds = scale x sum over its pieces of (a x len^2 + b x len),
plus c a micro-batch, scaled so that a micro-batch takes ~20 ms. Two cases, each under a job file
whose model is wrong:
- `attention`: attention-dominated truth (a = 1, b = 200: long context) with a nearly linear job
  model (quadratic 0.001, linear 1);
- `linear`: linear truth (a = 1, b = 40,000) with a purely quadratic job model.
Per case three runs (token_slack 0.25, so the planner trades tokens against cost): the job file
with calibrate: true, the same with the true model and no calibration (the oracle), and the
wrong model uncalibrated. Figures: the realised max/mean of the *true* cost per step over the
steps from --after on (median), the step the calibrated model took effect, and the coefficients
found against the truth (a/b ratio).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile

import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_output import emit  # noqa: E402
from coordinator.journal import read_cost_journal  # noqa: E402
from msd.testing.local import LocalJob  # noqa: E402

SPAWN = mp.get_context("spawn")
CASES = {
    "attention": {"truth": (1.0, 200.0, 0.0), "job": {"quadratic": 0.001, "linear": 1.0}},
    "linear": {"truth": (1.0, 40000.0, 0.0), "job": {"quadratic": 1.0, "linear": 0.0}},
}
WORDS = "one loader plans every global batch from metadata and balances attention cost".split()


def make_corpus(path: str, n: int = 6000) -> None:
    if os.path.exists(path):
        return
    rng = random.Random(0)
    with open(path + ".tmp", "wb") as f:
        for _ in range(n):  # long-tailed: mostly short documents, some near the row length
            words = int(min(900, 8 + rng.paretovariate(1.1) * 20))
            f.write(orjson.dumps({"text": " ".join(rng.choices(WORDS, k=words))}) + b"\n")
    os.replace(path + ".tmp", path)


def write_job(root: str, name: str, ranks: int, cost: dict, calibrate: bool) -> str:
    job = {"seed": 3, "sources": {"text": {"format": "jsonl", "paths": ["corpus.jsonl"]}},
           "batch": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 2 * ranks},
           "topology": {"dp": ranks}, "mixture": {"weights": {"text": 1.0}},
           "balance": {"cost": cost, "token_slack": 0.25, "calibrate": calibrate},
           "runtime": {"heartbeat_s": 1.0, "prepare_batch": 64}}
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def _rank(address: str, rank: int, steps: int, truth: tuple, scale: float, out) -> None:
    import time

    from trainer_client import DataClient

    a, b, c = truth
    client = DataClient(address, rank=rank, as_torch=False, timeout_s=300)
    per_step: dict[int, float] = {}
    for batch in client:
        lengths = batch["piece_lengths"].astype(float)
        cost = float((a * lengths * lengths + b * lengths).sum() + c)
        per_step[batch["step"]] = per_step.get(batch["step"], 0.0) + cost
        time.sleep(scale * cost)
        if batch["micro_batch"] == client.micro_batches_per_step - 1 and batch["step"] + 1 >= steps:
            break
    client.close()
    out.put((rank, per_step))


def run(path: str, ranks: int, steps: int, truth: tuple, scale: float, state_dir: str) -> dict:
    with LocalJob(path, workers=2, state_dir=state_dir) as cluster:
        out = SPAWN.Queue()
        procs = [SPAWN.Process(target=_rank, args=(cluster.address, r, steps, truth, scale, out)) for r in range(ranks)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=1800) for _ in procs)
        for p in procs:
            p.join(30)
    ratios = []
    for step in range(steps):
        costs = [results[r][step] for r in range(ranks)]
        ratios.append(max(costs) / (sum(costs) / len(costs)))
    return {"true_max_over_mean": ratios, "cost_changes": read_cost_journal(state_dir)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--after", type=int, default=50, help="steps from which max/mean is compared")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ms-per-micro-batch", type=float, default=20.0)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "msd-bench-calibrate"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.data_dir, exist_ok=True)
    make_corpus(os.path.join(args.data_dir, "corpus.jsonl"))
    result = {"benchmark": "calibrate", "command": "python tools/bench_calibrate.py " + " ".join(sys.argv[1:]),
              "ranks": args.ranks, "steps": args.steps, "after": args.after, "cases": {}}
    for name, case in CASES.items():
        a, b, c = case["truth"]
        # a micro-batch of ~1.25 x 4096 tokens in documents of ~600 tokens: scale it to the wanted time
        typical = 8 * (a * 640 * 640 + b * 640) + c
        scale = args.ms_per_micro_batch / 1000 / typical
        true_cost = {"quadratic": a, "linear": b}
        runs = {}
        for kind, cost, calibrate in (("calibrated", case["job"], True), ("oracle", true_cost, False),
                                      ("uncalibrated", case["job"], False)):
            path = write_job(args.data_dir, f"{name}-{kind}", args.ranks, cost, calibrate)
            state = tempfile.mkdtemp(prefix=f"state-{name}-{kind}-", dir=args.data_dir)
            runs[kind] = run(path, args.ranks, args.steps, case["truth"], scale, state)
        late = {k: statistics.median(r["true_max_over_mean"][args.after:]) for k, r in runs.items()}
        changes = runs["calibrated"]["cost_changes"]
        found = changes[-1][1] if changes else None
        result["cases"][name] = {
            "truth": {"a": a, "b": b, "c": c},
            "job_model": case["job"],
            "true_max_over_mean_after": {k: round(v, 4) for k, v in late.items()},
            "calibrated_over_oracle": round(late["calibrated"] / late["oracle"], 4),
            "adopted_at_steps": [at for at, _ in changes],
            "coefficients_found": found,
            "ratio_a_over_b_found_over_true": round((found[0] / found[1]) / (a / b), 4) if found and found[1] else None,
        }
        print(f"# {name}: {result['cases'][name]}", file=sys.stderr)
    emit(result, args.json)


if __name__ == "__main__":
    main()
