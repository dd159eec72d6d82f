"""What mixture.adapt costs the coordinator: CPU per step with the ranks reporting their training
loss per source (as `DataClient.report_loss` sends it, with each `consumed`) and the policy
deciding every 5 steps, against the same job with static weights. tools/bench_scale.py's fleet: a
real `msd coordinator` and `msd worker --procs 2`, light ranks speaking the real protocol (behind
simulated relays with --per-relay), alternated static / adapt for --rounds rounds.

    python tools/bench_adapt_cost.py --dp 512 --per-relay 0 --rounds 3 --json OUT

With --in-process: the coordinator's own part of a step behind relays, counted in one process
without the noise of a shared machine: each relay's relay_up decoded into its event, and with
adapt its loss table taken (RelayBook.losses, AdaptBook.report_table) and the step's losses folded
(AdaptBook.decide), against the same relay_ups without losses; alternated, CPU time per step.

    python tools/bench_adapt_cost.py --in-process --dp 4096 --per-relay 8 --rounds 7 --json OUT
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from bench_output import emit  # noqa: E402
from bench_scale import run_point  # noqa: E402


def in_process(dp: int, per_relay: int, sources: int, rounds: int, policy: str = "ado", steps: int = 10) -> dict:
    """CPU ms per step of the relay_ups' part of the coordinator's work, with and without adapt."""
    import time

    from coordinator.adapt import AdaptBook
    from coordinator.relaying import RelayEnvelopes
    from coordinator.registry import Registry, TrainerInfo
    from coordinator.relay_book import RelayBook
    from msd_common import protocol as P
    from msd_common import wire
    from msd_common.spec import AdaptConfig
    from msd_common.topology import Topology

    registry = Registry()
    relays = [registry.add_relay(f"relay{i}".encode(), f"h{i}", "tcp://x", "ipc://x", 0.0)
              for i in range(dp // per_relay)]
    for r in range(dp):
        registry.add_trainer(TrainerInfo(r, f"rank{r}".encode(), "tcp://x", 0.0, via=relays[r // per_relay].relay_id))
    book = RelayBook(registry, Topology(dp=dp), 1.0)
    envelopes = RelayEnvelopes()

    def frames(relay: int, step: int, losses: bool) -> list[bytes]:
        ranks = list(range(relay * per_relay, (relay + 1) * per_relay))
        extra = {}
        if losses:
            rows = [(r, step - 1, s, 64) for r in ranks for s in range(sources)]
            extra = {"losses": np.array(rows, np.int64), "loss_sums": 64 * (2.0 + np.arange(len(rows)) % 7 / 10)}
        return [bytes(f) for f in wire.encode(P.RelayUp(relay_id=relay, messages=[], ranks=ranks,
                                                        consumed=np.array([[r, step] for r in ranks], np.int64),
                                                        waited_s=np.zeros(len(ranks)), **extra))]

    def run(adapt: bool) -> float:
        adapt_book = AdaptBook(AdaptConfig(policy, 5), [f"s{i}" for i in range(sources)], 2, lambda r: r, [], 0)
        messages = {step: [frames(i, step, adapt) for i in range(len(relays))] for step in range(1, steps + 1)}
        started = time.process_time()
        for step in range(1, steps + 1):
            for i, fr in enumerate(messages[step]):
                header, arrays = wire.decode(fr, P.COORDINATOR_INBOX)
                ev = envelopes.unpack(relays[i].identity, 0.0, header, arrays)[-1]
                book.consumed(ev, relays[i])
                if adapt and (losses := book.losses(ev, relays[i])) is not None:
                    adapt_book.report_table(*losses)
            if adapt:
                adapt_book.decide(step, lambda at: [1.0 / sources] * sources)
        return 1000 * (time.process_time() - started) / steps

    cpu: dict[str, list[float]] = {"static": [], policy: []}
    for _ in range(rounds):
        cpu["static"].append(run(False))
        cpu[policy].append(run(True))
    med = {d: statistics.median(v) for d, v in cpu.items()}
    return {"dp": dp, "per_relay": per_relay, "sources": sources, "rounds": rounds,
            "relay_ups_ms_per_step": {d: {"median": round(med[d], 2), "min": round(min(v), 2), "max": round(max(v), 2)}
                                      for d, v in cpu.items()},
            "adapt_ms_per_step": round(med[policy] - med["static"], 2)}


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
    ap.add_argument("--in-process", action="store_true", help="count the relay_ups' part in one process")
    args = ap.parse_args()
    if args.in_process:
        emit(in_process(args.dp, args.per_relay or 8, args.sources, args.rounds, args.policy), args.json)
        return
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
    emit(out, args.json)


if __name__ == "__main__":
    main()
