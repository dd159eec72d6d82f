"""Does mixing that learns (mixture.adapt) save steps? A tiny causal LM (tools/train_tiny.py) trained
on CPU from a real msd job over three sources that differ in what they can teach:

- `noise`: random tokens, uniform over the 256 byte ids (nothing to learn: no model does better
  than ln 256);
- `repeated`: a handful of paragraphs repeated over and over (learnt, then nothing more);
- `text`: the Python standard library's source files, line blocks in order (real text).

Each design trains the same model from the same seed for --steps steps, evaluating every
--eval-every steps on an eval set holding out records of every source (loss per source). Designs:
`static` (the job's weights throughout) and each policy. Figures: held-out loss per source at
equal steps, the mean held-out loss over the learnable sources (`text`, `repeated`), and the steps
each design takes to reach static's final value of each (fewer is better; at the resolution of
--eval-every).

    python tools/bench_adapt.py --steps 120 --eval-every 10 --json docs/results/issue60/bench-adapt.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import orjson  # noqa: E402

from msd.testing.local import LocalJob  # noqa: E402
from msd.testing.ports import free_port  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402

LEARNABLE = ("text", "repeated")


def write_sources(root: str, records: int = 3000) -> None:
    os.makedirs(root, exist_ok=True)
    # random tokens, uniform over the byte vocabulary: no model does better than ln 256 on them
    noise = np.random.default_rng(0)
    write_megatron(os.path.join(root, "noise_text_document"),
                   (noise.integers(0, 256, 400, dtype=np.uint16) for _ in range(records)))
    paragraphs = ["the quick brown fox jumps over the lazy dog while the cat sleeps by the warm fire. " * 3,
                  "a stitch in time saves nine, and a penny saved is a penny earned, said the old clerk. " * 3,
                  "numbers rise and fall: one, two, three, four, five, six, seven, eight, nine, ten. " * 3]
    with open(os.path.join(root, "repeated.jsonl"), "wb") as f:
        for i in range(records):
            f.write(orjson.dumps({"text": paragraphs[i % len(paragraphs)]}) + b"\n")
    stdlib = sysconfig.get_paths()["stdlib"]
    blocks = []
    for name in sorted(os.listdir(stdlib)):
        if name.endswith(".py"):
            with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as src:
                lines = src.read().splitlines()
            blocks += ["\n".join(lines[i:i + 12]) for i in range(0, len(lines), 12)]
        if len(blocks) >= records:
            break
    with open(os.path.join(root, "text.jsonl"), "wb") as f:
        for block in blocks[:records]:
            f.write(orjson.dumps({"text": block}) + b"\n")


def job(root: str, policy: str | None, every: int, seed: int = 7) -> str:
    sources = {name: {"format": "jsonl", "paths": [f"{name}.jsonl"], "text_key": "text", "tokenizer": "byte"}
               for name in ("repeated", "text")}
    sources = {"noise": {"format": "megatron", "paths": ["noise_text_document"]}, **sources}
    mixture: dict = {"weights": {"noise": 1.0, "repeated": 1.0, "text": 1.0}}
    if policy is not None:
        mixture["adapt"] = {"policy": policy, "every_steps": every, "min_weight": 0.05, "max_step_change": 0.1}
    spec = {"seed": seed, "sources": sources,
            "batch": {"seq_len": 256, "micro_batch_size": 4, "global_batch_size": 8, "pad_id": 257},
            "topology": {"dp": 1}, "mixture": mixture,
            "eval": {"heldout": {"holdout": {"noise": 40, "repeated": 100, "text": 100}}},
            "runtime": {"heartbeat_s": 0.5, "lookahead_steps": 2}}
    path = os.path.join(root, f"job-{policy or 'static'}-{seed}.yaml")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def train(path: str, out: str, steps: int, every: int, seed: int = 0) -> tuple[list, list, float, list]:
    """The run's training losses, held-out losses, seconds, and mixture changes [(step, weights)]."""
    from coordinator.journal import read_mixture_journal

    evals = os.path.join(out, "evals.json")
    losses = os.path.join(out, "losses.json")
    state = os.path.join(out, "state")
    started = time.monotonic()
    with LocalJob(path, workers=1, state_dir=state) as cluster:
        done = subprocess.run([sys.executable, os.path.join(HERE, "train_tiny.py"), "--coordinator", cluster.address,
                               "--steps", str(steps), "--world-size", "1", "--port", str(free_port()),
                               "--losses", losses, "--eval-every", str(every), "--eval-losses", evals,
                               "--report-loss", "--seed", str(seed)], capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    changes = [(at, [round(w, 3) for w in weights]) for at, weights in read_mixture_journal(state)]
    with open(losses) as f, open(evals) as g:
        return json.load(f), json.load(g), time.monotonic() - started, changes


def steps_to(curve: list, target: tuple[dict, float]) -> dict:
    """The first evaluation at or below static's final value of each source and of the learnable
    mean, as a step count (None: never within the run)."""
    by_source, mean = target
    return {**{s: next((step + 1 for step, by, _ in curve if by[s] <= by_source[s]), None) for s in by_source},
            "learnable_mean": next((step + 1 for step, _, m in curve if m <= mean), None)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--adapt-every", type=int, default=5)
    ap.add_argument("--designs", default="static,loss_share,odm,ado")
    ap.add_argument("--seeds", default="7", help="job seeds (the model's initial weights follow them)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    out: dict = {"steps": args.steps, "eval_every": args.eval_every, "adapt_every": args.adapt_every,
                 "seeds": seeds, "designs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        write_sources(tmp)
        for seed in seeds:  # the designs alternate within each seed
            for design in args.designs.split(","):
                run = os.path.join(tmp, f"{design}-{seed}")
                os.makedirs(run)
                path = job(tmp, None if design == "static" else design, args.adapt_every, seed)
                _, evals, seconds, changes = train(path, run, args.steps, args.eval_every, seed)
                curve = [(step, {s: round(v, 4) for s, v in by.items()},
                          round(sum(by[s] for s in LEARNABLE) / len(LEARNABLE), 4)) for step, by in evals]
                runs = out["designs"].setdefault(design, {"runs": {}})["runs"]
                runs[seed] = {"seconds": round(seconds, 1), "curve": curve, "mixture_changes": changes,
                              "final": curve[-1][1], "final_learnable_mean": curve[-1][2]}
                print(design, seed, curve[-1], flush=True)
    static = out["designs"].get("static", {}).get("runs")
    for design, d in out["designs"].items():
        for seed, run in d["runs"].items():
            if static:
                last = static[seed]["curve"][-1]
                run["steps_to_static_final"] = steps_to(run["curve"], (last[1], last[2]))
        if static:
            d["median_steps_to_static_final"] = {
                k: _median([run["steps_to_static_final"][k] for run in d["runs"].values()])
                for k in next(iter(d["runs"].values()))["steps_to_static_final"]}
    print(json.dumps({k: {"median_steps_to_static_final": v.get("median_steps_to_static_final"),
                          "per_seed": {s: r.get("steps_to_static_final") for s, r in v["runs"].items()}}
                      for k, v in out["designs"].items()}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def _median(values: list) -> float | None:
    """The median, a run that never got there counting as the largest (None if half never did)."""
    ordered = sorted(values, key=lambda v: float("inf") if v is None else v)
    mid = ordered[len(ordered) // 2] if len(ordered) % 2 else None
    if len(ordered) % 2 == 0:
        a, b = ordered[len(ordered) // 2 - 1], ordered[len(ordered) // 2]
        mid = None if a is None or b is None else (a + b) / 2
    return mid


if __name__ == "__main__":
    main()
