"""Soak: a job running for minutes with a worker process killed now and then; resident memory
of every process over time, and message rates.

    python tools/soak.py --minutes N --json OUT [--ranks 2] [--workers 2] [--kill-every-s 20]

Runs a Megatron source and a JSONL source (generated, so nothing is needed up front), one
coordinator (with --state-dir: its step journal is part of what is measured), a worker host
with W processes and R trainer ranks. Every --sample-s it records VmRSS of the coordinator,
the host agent, each worker process and each rank; every --kill-every-s it SIGKILLs one worker
process (the host starts a new one). Reports, per process role, RSS after warm-up (the first
--warmup-fraction of the run) and at the end and the growth between them, plus steps/s and
coordinator messages/s. Target: no process grows by more than 5 % after warm-up.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import signal
import sys
import tempfile
import time

import numpy as np
import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402  (tools/ is on the path when run as a script)
from msd.testing.local import LocalJob  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402

SPAWN = mp.get_context("spawn")


def make_job(root: str) -> str:
    rng = np.random.default_rng(0)
    lengths = np.clip((rng.pareto(1.5, 20_000) * 300 + 50).astype(int), 50, 60_000)
    prefix = os.path.join(root, "tokens_text_document")
    write_megatron(prefix, (rng.integers(0, 50_000, n, dtype=np.uint16) for n in lengths), np.uint16)
    words = ["data", "loader", "token", "batch", "rank", "worker", "plan", "step", "merge", "shard"]
    with open(os.path.join(root, "text.jsonl"), "wb") as f:
        for i in range(20_000):
            n = int(rng.integers(20, 400))
            f.write(orjson.dumps({"text": " ".join(rng.choice(words, n).tolist()) + f" #{i}"}) + b"\n")
    job = {
        "seed": 3,
        "sources": {"tokens": {"format": "megatron", "paths": [prefix]},
                    "text": {"format": "jsonl", "paths": ["text.jsonl"]}},
        "batch": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 8},
        "topology": {"dp": 2},
        "mixture": {"weights": {"tokens": 0.7, "text": 0.3}},
        "runtime": {"heartbeat_s": 0.5, "status_every_s": 5.0},
    }
    path = os.path.join(root, "soak.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def _rank(address: str, rank: int, deadline: float, out) -> None:
    from trainer_client import DataClient, PeerLostError

    client = DataClient(address, rank=rank, as_torch=False, timeout_s=120)
    steps = 0
    try:
        for batch in client:
            if batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
                steps += 1
            if time.time() > deadline:
                break
    except PeerLostError:  # after the deadline the other ranks leave, and planning stops for all
        if time.time() < deadline:
            raise
    finally:
        out.put((rank, steps))
        client.close()


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-every-s", type=float, default=20.0)
    ap.add_argument("--sample-s", type=float, default=5.0)
    ap.add_argument("--warmup-fraction", type=float, default=0.2)
    args = ap.parse_args()
    rng = random.Random(1)
    with tempfile.TemporaryDirectory() as root:
        os.environ["MSD_CACHE_DIR"] = os.path.join(root, "cache")
        job_path = make_job(root)
        state_dir = os.path.join(root, "state")
        started = time.time()
        deadline = started + args.minutes * 60
        samples: list[dict] = []
        kills = 0
        with LocalJob(job_path, workers=args.workers, state_dir=state_dir) as cluster:
            out = SPAWN.Queue()
            ranks = [SPAWN.Process(target=_rank, args=(cluster.address, r, deadline, out)) for r in range(args.ranks)]
            for p in ranks:
                p.start()
            next_kill = time.time() + args.kill_every_s
            while time.time() < deadline:
                time.sleep(args.sample_s)
                now = time.time()
                sample = {"t": now - started, "coordinator": rss_kib(cluster.coordinator.pid),
                          "host": rss_kib(cluster.host.pid),
                          "workers": [rss_kib(p) for p in cluster.worker_pids()],
                          "ranks": [rss_kib(p.pid) for p in ranks]}
                try:
                    with open(os.path.join(state_dir, "status.json"), "rb") as f:
                        sample["status"] = orjson.loads(f.read())
                except (OSError, orjson.JSONDecodeError):
                    pass
                samples.append(sample)
                if now >= next_kill and cluster.worker_pids():
                    os.kill(rng.choice(cluster.worker_pids()), signal.SIGKILL)
                    kills += 1
                    next_kill = now + args.kill_every_s
            steps = [out.get(timeout=180) for _ in ranks]
            for p in ranks:
                p.join(30)
    emit(summarize(samples, steps, kills, args), args.json_path)


def summarize(samples: list[dict], steps: list, kills: int, args) -> dict:
    warm = [s for s in samples if s["t"] >= args.warmup_fraction * args.minutes * 60] or samples

    def role(name, pick):
        values = [v for v in map(pick, warm) if v]  # samples where the role's processes were alive
        if len(values) < 2:
            return None
        a, b = values[0], values[-1]
        return {"rss_after_warmup_mib": a / 1024, "rss_end_mib": b / 1024, "growth": b / a - 1}

    def median_of(key):
        return lambda s: float(np.median([x for x in s[key] if x])) if any(s[key]) else None

    roles = {
        "coordinator": role("coordinator", lambda s: s["coordinator"]),
        "host_agent": role("host", lambda s: s["host"]),
        # worker processes are replaced by the kills: compare the median of those alive
        "worker_median": role("workers", median_of("workers")),
        "rank_max": role("ranks", lambda s: max(x for x in s["ranks"] if x) if any(s["ranks"]) else None),
    }
    statuses = [s["status"] for s in warm if "status" in s]
    msg_rate = None
    if len(statuses) >= 2 and statuses[-1]["time"] > statuses[0]["time"]:
        span = statuses[-1]["time"] - statuses[0]["time"]
        msg_rate = (statuses[-1]["messages_received"] + statuses[-1]["messages_sent"]
                    - statuses[0]["messages_received"] - statuses[0]["messages_sent"]) / span
    worst = max((r["growth"] for r in roles.values() if r), default=None)
    return {
        "benchmark": "soak",
        "minutes": args.minutes,
        "ranks": args.ranks,
        "worker_processes": args.workers,
        "workers_killed": kills,
        "steps_per_s": min(n for _, n in steps) / (args.minutes * 60),
        "coordinator_messages_per_s": msg_rate,
        "roles": roles,
        "worst_growth_after_warmup": worst,
        "target_growth": 0.05,
        "samples": samples,
    }


if __name__ == "__main__":
    main()
