"""How long ranks go without data when the serving coordinator goes away and its standby takes over:
after a crash (SIGKILL: the standby takes the lease once it has not been renewed for 3 heartbeats)
and after a graceful stop (SIGTERM: the coordinator gives its lease up, then tells its peers to move
on). Alternated rounds on one machine, printed as JSON:

    python tools/bench_failover.py --rounds 3 --json docs/results/bench-failover.json

For each signal: the seconds from the signal to the first micro-batch every rank has again (the
longest of the ranks; median, min and max over the rounds), and whether each rank's stream equals
the run without a stop (it must)."""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

import orjson

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from msd.testing.local import LocalJob  # noqa: E402
from tests.conftest import build_dataset, job_dict, write_job  # noqa: E402  (the test suite's small corpus)

RANKS = 2
STEPS = 40
STOP_AT_BATCH = 10  # micro-batches each rank has before the signal


def _rank(address: str, rank: int, out: dict, stop: threading.Event, compute_s: float) -> None:
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=False, timeout_s=120, stop_grace_s=60)
    got = out[rank] = []
    try:
        for batch in client:
            got.append((time.monotonic(), batch["step"], tuple(batch["doc_keys"].tolist())))
            time.sleep(compute_s)
            if batch["step"] + 1 >= STEPS and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
                break
    finally:
        client.close()
        stop.set()


def one_round(job_path: str, sig: int | None, heartbeat_s: float, compute_s: float) -> dict:
    out: dict[int, list] = {}
    with tempfile.TemporaryDirectory() as state:
        with LocalJob(job_path, workers=2, state_dir=state, standby=True, log_level="WARNING") as cluster:
            done = [threading.Event() for _ in range(RANKS)]
            threads = [threading.Thread(target=_rank, args=(cluster.address, r, out, done[r], compute_s))
                       for r in range(RANKS)]
            for t in threads:
                t.start()
            signalled = None
            while not all(d.is_set() for d in done):
                if sig is not None and signalled is None and all(len(out.get(r, ())) >= STOP_AT_BATCH
                                                                 for r in range(RANKS)):
                    signalled = time.monotonic()
                    os.kill(cluster.coordinator.pid, sig)
                time.sleep(0.005)
            for t in threads:
                t.join()
    stream = {r: [(step, keys) for _, step, keys in batches] for r, batches in out.items()}
    gap = None
    if signalled is not None:
        gap = max(next(at for at, _, _ in out[r] if at > signalled) - signalled for r in range(RANKS))
    return {"gap_s": gap, "stream": stream}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--compute-ms", type=float, default=20.0, help="the trainer's compute per micro-batch")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        build_dataset(root)
        job = job_dict(runtime={"heartbeat_s": args.heartbeat_s, "prepare_batch": 16, "lookahead_steps": 3})
        path = write_job(root, job, "failover.yaml")
        clean = one_round(path, None, args.heartbeat_s, args.compute_ms / 1000)["stream"]
        gaps: dict[str, list[float]] = {"SIGKILL": [], "SIGTERM": []}
        equal = {"SIGKILL": True, "SIGTERM": True}
        for k in range(args.rounds):
            for name in ("SIGKILL", "SIGTERM") if k % 2 == 0 else ("SIGTERM", "SIGKILL"):
                result = one_round(path, getattr(signal, name), args.heartbeat_s, args.compute_ms / 1000)
                gaps[name].append(round(result["gap_s"], 3))
                equal[name] = equal[name] and result["stream"] == clean
                print(f"round {k}: {name}: ranks without data for {result['gap_s']:.2f}s", file=sys.stderr)
    summary = {
        "heartbeat_s": args.heartbeat_s, "compute_ms": args.compute_ms, "rounds": args.rounds,
        **{name: {"median_s": statistics.median(g), "min_s": min(g), "max_s": max(g), "all_s": g,
                  "stream_equal": equal[name]} for name, g in gaps.items()},
    }
    summary["sigterm_over_sigkill"] = round(summary["SIGTERM"]["median_s"] / summary["SIGKILL"]["median_s"], 3)
    text = orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
