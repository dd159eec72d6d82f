"""What mixture.adapt costs the coordinator: CPU per step with the ranks reporting their training
loss per source (as `DataClient.report_loss` sends it, with each `consumed`) and the policy
deciding every 5 steps, against the same job with static weights. tools/bench_scale.py's fleet: a
real `msd coordinator` and `msd worker --procs 2`, light ranks speaking the real protocol (behind
simulated relays with --per-relay), alternated static / adapt for --rounds rounds.

    python tools/bench_adapt_cost.py --dp 512 --per-relay 0 --rounds 3 --json OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_scale import run_point  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=512)
    ap.add_argument("--per-relay", type=int, default=0, help="ranks per simulated relay (0: direct)")
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--policy", default="ado")
    ap.add_argument("--json", required=True)
    ap.add_argument("--data-dir", default=None)
    args = ap.parse_args()
    root = args.data_dir or tempfile.mkdtemp(prefix="msd-adapt-cost-")
    runs: dict[str, list[dict]] = {"static": [], args.policy: []}
    for _ in range(args.rounds):
        for design in runs:
            row = run_point(root, args.dp, args.sources, 10**5, args.steps, step_s=1.0, per_relay=args.per_relay,
                            adapt=None if design == "static" else design)
            runs[design].append(row)
            print(design, row.get("coordinator_cpu_ms_per_step"), row.get("steps_per_s"), flush=True)
    cpu = {d: [r.get("coordinator_cpu_ms_per_step") for r in rows] for d, rows in runs.items()}
    summary = {d: {"median_ms_per_step": statistics.median(v), "min": min(v), "max": max(v)} for d, v in cpu.items()}
    summary["ratio_of_medians"] = round(summary[args.policy]["median_ms_per_step"] /
                                        summary["static"]["median_ms_per_step"], 3)
    out = {"dp": args.dp, "per_relay": args.per_relay, "sources": args.sources, "steps": args.steps,
           "policy": args.policy, "cpu_ms_per_step": cpu, "summary": summary, "runs": runs}
    print(json.dumps(summary, indent=1))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
