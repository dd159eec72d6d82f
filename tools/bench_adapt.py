"""Does mixing that learns (mixture.adapt) save steps? A tiny causal LM (tools/train_tiny.py) trained
on CPU from a real msd job over three sources that differ in what they can teach:

- `noise`: random bytes (nothing to learn: its loss stays near ln 256);
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
import random
import subprocess
import sys
import sysconfig
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

import orjson  # noqa: E402

from msd.testing.local import LocalJob  # noqa: E402
from msd.testing.ports import free_port  # noqa: E402

LEARNABLE = ("text", "repeated")


def write_sources(root: str, records: int = 3000) -> None:
    rng = random.Random(0)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "noise.jsonl"), "wb") as f:
        for _ in range(records):
            f.write(orjson.dumps({"text": "".join(chr(rng.randrange(32, 127)) for _ in range(400))}) + b"\n")
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


def job(root: str, policy: str | None, every: int) -> str:
    sources = {name: {"format": "jsonl", "paths": [f"{name}.jsonl"], "text_key": "text", "tokenizer": "byte"}
               for name in ("noise", "repeated", "text")}
    mixture: dict = {"weights": {"noise": 1.0, "repeated": 1.0, "text": 1.0}}
    if policy is not None:
        mixture["adapt"] = {"policy": policy, "every_steps": every, "min_weight": 0.05, "max_step_change": 0.1}
    spec = {"seed": 7, "sources": sources,
            "batch": {"seq_len": 256, "micro_batch_size": 4, "global_batch_size": 8, "pad_id": 257},
            "topology": {"dp": 1}, "mixture": mixture,
            "eval": {"heldout": {"holdout": {"noise": 40, "repeated": 40, "text": 40}}},
            "runtime": {"heartbeat_s": 0.5, "lookahead_steps": 2}}
    path = os.path.join(root, f"job-{policy or 'static'}.yaml")
    with open(path, "w") as f:
        json.dump(spec, f)
    return path


def train(path: str, out: str, steps: int, every: int) -> tuple[list, list, float]:
    evals = os.path.join(out, "evals.json")
    losses = os.path.join(out, "losses.json")
    started = time.monotonic()
    with LocalJob(path, workers=1) as cluster:
        done = subprocess.run([sys.executable, os.path.join(HERE, "train_tiny.py"), "--coordinator", cluster.address,
                               "--steps", str(steps), "--world-size", "1", "--port", str(free_port()),
                               "--losses", losses, "--eval-every", str(every), "--eval-losses", evals,
                               "--report-loss"], capture_output=True, text=True, timeout=3600,
                              env={**os.environ, "PYTHONPATH": ROOT})
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    with open(losses) as f, open(evals) as g:
        return json.load(f), json.load(g), time.monotonic() - started


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--adapt-every", type=int, default=5)
    ap.add_argument("--designs", default="static,loss_share,odm,ado")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out: dict = {"steps": args.steps, "eval_every": args.eval_every, "adapt_every": args.adapt_every, "designs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        write_sources(tmp)
        for design in args.designs.split(","):
            run = os.path.join(tmp, design)
            os.makedirs(run)
            path = job(tmp, None if design == "static" else design, args.adapt_every)
            _, evals, seconds = train(path, run, args.steps, args.eval_every)
            curve = [(step, {s: round(v, 4) for s, v in by.items()},
                      round(sum(by[s] for s in LEARNABLE) / len(LEARNABLE), 4)) for step, by in evals]
            out["designs"][design] = {"seconds": round(seconds, 1), "curve": curve}
            print(design, curve[-1], flush=True)
    static = out["designs"].get("static", {}).get("curve")
    for design, d in out["designs"].items():
        d["final"] = d["curve"][-1][1]
        d["final_learnable_mean"] = d["curve"][-1][2]
        if static:  # the first evaluation at or below static's final value (None: never within --steps)
            d["steps_to_static_final"] = {
                **{s: next((step + 1 for step, by, _ in d["curve"] if by[s] <= static[-1][1][s]), None)
                   for s in static[-1][1]},
                "learnable_mean": next((step + 1 for step, _, mean in d["curve"] if mean <= static[-1][2]), None)}
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "curve"} for k, v in out["designs"].items()},
                     indent=2))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
