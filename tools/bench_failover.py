"""How long ranks go without data when the serving coordinator goes away and its standby takes over:
after a crash (SIGKILL: the standby takes the lease once it has not been renewed for 3 heartbeats)
and after a graceful stop (SIGTERM: the coordinator gives its lease up, then tells its peers to move
on). Alternated rounds on one machine, printed as JSON:

    python tools/bench_failover.py --rounds 3 --json docs/results/bench-failover.json

For each signal, medians over the rounds: `served_again_s`, the seconds from the signal until every
rank has a micro-batch of a step the old coordinator cannot have planned (the standby serves), and
`longest_wait_s`, the longest a rank waited between two micro-batches after the signal (the steps
delivered ahead cover part of the handover); and whether each rank's stream equals the run without
a stop (it must)."""

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
LOOKAHEAD = 3  # runtime.lookahead_steps of the job


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
    result: dict = {"stream": stream}
    if signalled is not None:
        # the first step no coordinator can have planned before the signal: the slowest rank's step
        # then, plus the look-ahead, plus one for a pass under way
        first_new = min(max((step for at, step, _ in out[r] if at <= signalled), default=-1)
                        for r in range(RANKS)) + LOOKAHEAD + 2
        result["served_again_s"] = max(next(at for at, step, _ in out[r] if step >= first_new) - signalled
                                       for r in range(RANKS))
        result["longest_wait_s"] = max(max(b - a for a, b in zip(*(lambda t: (t, t[1:]))(
            [at for at, _, _ in out[r]])) if b > signalled) for r in range(RANKS))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--compute-ms", type=float, default=20.0, help="the trainer's compute per micro-batch")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as root:
        build_dataset(root)
        job = job_dict(runtime={"heartbeat_s": args.heartbeat_s, "prepare_batch": 16, "lookahead_steps": LOOKAHEAD})
        path = write_job(root, job, "failover.yaml")
        clean = one_round(path, None, args.heartbeat_s, args.compute_ms / 1000)["stream"]
        figures = {name: {"served_again_s": [], "longest_wait_s": []} for name in ("SIGKILL", "SIGTERM")}
        equal = {"SIGKILL": True, "SIGTERM": True}
        for k in range(args.rounds):
            for name in ("SIGKILL", "SIGTERM") if k % 2 == 0 else ("SIGTERM", "SIGKILL"):
                result = one_round(path, getattr(signal, name), args.heartbeat_s, args.compute_ms / 1000)
                for key in figures[name]:
                    figures[name][key].append(round(result[key], 3))
                equal[name] = equal[name] and result["stream"] == clean
                print(f"round {k}: {name}: served by the standby after {result['served_again_s']:.2f}s, longest "
                      f"wait for a batch {result['longest_wait_s']:.2f}s", file=sys.stderr)
    summary = {
        "heartbeat_s": args.heartbeat_s, "compute_ms": args.compute_ms, "rounds": args.rounds,
        **{name: {**{f"{key}_median": statistics.median(v) for key, v in f.items()},
                  **{f"{key}_all": v for key, v in f.items()}, "stream_equal": equal[name]}
           for name, f in figures.items()},
    }
    summary["sigterm_over_sigkill"] = round(summary["SIGTERM"]["served_again_s_median"] /
                                            summary["SIGKILL"]["served_again_s_median"], 3)
    text = orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode()
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
