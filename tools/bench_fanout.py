"""What relays (one per trainer host, `msd relay`) save: coordinator CPU, data connections, and
what they cost the trainer (its data wait).

    python tools/bench_fanout.py --json OUT [--dp 64,512,4096] [--per-relay 8] [--steps N] [--skip-wait]

Part 1, fan-out (tools/bench_scale.py's fleet): per DP size, a real `msd coordinator` and a
real `msd worker` host with 2 worker processes, and DP light ranks (tools/scale_ranks.py: the
real protocol and ReceivingState), either each speaking for itself (direct) or behind simulated
relays of --per-relay ranks each (a trainer host: the real relay protocol to the coordinator and
one data socket for the workers; the relay hands pieces to its ranks in-process rather than over
ipc). The ranks consume a step a second, as a synchronous job does. Reported: the coordinator's
CPU per step (all its threads; its event loop's alone; the others': ZeroMQ's I/O thread and the
HTTP threads serving /metrics, scraped every --scrape-every-s; a scrape's own CPU is measured in
this process after the fleet, `scrape`) and the messages it handles, and
the sockets of each worker process (its data
connections, one per rank or one per relay, plus its few own).

Part 2, the trainer's data wait at 8 ranks on one host through one real `msd relay` against the
direct path: tools/bench_wait.py's setting (its job, its 8 trainer processes that compute 50 ms
per micro-batch), alternated, the wait share and the time inside next() of each.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import orjson

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402
from bench_scale import run_point  # noqa: E402

TOKENS = 2048  # per rank per step: the coordinator's work is per rank and per piece, not per token


def scrape_cost(dp: int, per_relay: int, repeats: int = 9) -> dict:
    """CPU ms of one /metrics scrape's text (prometheus-client's generate_latest) in this process,
    for DP ranks and their relays as a run's copy of the state holds them: median and spread."""
    import statistics
    import time

    from prometheus_client import generate_latest

    from coordinator.metrics import CoordinatorMetrics

    metrics = CoordinatorMetrics()
    relays = [{"host": f"host-{i}", "relay_id": i, "ranks": list(range(i * per_relay, (i + 1) * per_relay)),
               "bytes_in": 1 << 40, "bytes_out": 1 << 42, "queued": 0, "late_steps": 0}
              for i in range(dp // per_relay if per_relay else 0)]
    metrics.totals.copy = {**metrics.totals.copy, "wait": {str(r): 12.5 + r / 7 for r in range(dp)},
                           "consumed": {str(r): 1234 for r in range(dp)}, "relays": relays}
    generate_latest(metrics.registry)
    times = []
    for _ in range(repeats):
        started = time.process_time()
        text = generate_latest(metrics.registry)
        times.append(1000 * (time.process_time() - started))
    return {"dp": dp, "relays": len(relays), "lines": text.count(b"\n"),
            "cpu_ms_median": round(statistics.median(times), 1), "cpu_ms_min": round(min(times), 1),
            "cpu_ms_max": round(max(times), 1)}


def fan_out(data_dir: str, dps: list[int], per_relay: int, steps: int, scrape_s: float) -> list[dict]:
    rows = []
    for dp in dps:
        for relay in (0, per_relay):  # direct, then behind relays
            row = run_point(data_dir, dp, 1, 10**5, steps, step_s=1.0, per_relay=relay, tokens=TOKENS,
                            scrape_s=scrape_s)
            rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--dp", default="64,512,4096")
    ap.add_argument("--per-relay", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--scrape-every-s", type=float, default=3.0,
                    help="how often /metrics is scraped (the coordinator's HTTP threads pay per scrape)")
    ap.add_argument("--skip-wait", action="store_true")
    ap.add_argument("--wait-rounds", type=int, default=3)
    ap.add_argument("--wait-compute-ms", default="0,50", help="bench_wait.py's --compute-ms")
    ap.add_argument("--data-dir", default=os.path.expanduser("~/.cache/megascale-data/bench-scale"))
    args = ap.parse_args()
    result: dict = {"per_relay": args.per_relay, "tokens_per_rank_per_step": TOKENS,
                    "fan_out": fan_out(args.data_dir, [int(x) for x in args.dp.split(",")], args.per_relay, args.steps,
                                      args.scrape_every_s)}
    result["scrape"] = [scrape_cost(dp, args.per_relay) for dp in (int(x) for x in args.dp.split(","))]
    if not args.skip_wait:  # bench_wait.py itself, two of its designs alternated in each round
        out = os.path.join(tempfile.mkdtemp(prefix="msd-fanout-"), "wait.json")
        subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_wait.py"),
                        "--json", out, "--designs", "msd-two,msd-relay", "--compute-ms", args.wait_compute_ms,
                        "--repeats", str(args.wait_rounds)], check=True)
        with open(out, "rb") as f:
            wait = orjson.loads(f.read())
        result["data_wait"] = {"command": wait["command"], "ranks": wait["ranks"], "results": wait["results"]}
    emit(result, args.json)


if __name__ == "__main__":
    main()
