"""The stall each event of a real run's life causes: seconds of data wait beyond the event itself.

    python tools/bench_events.py --json bench-events.json [--repeats 3]

One job (a Megatron and a JSONL source, 2 ranks as processes, 2 worker processes, heartbeat
`--heartbeat-s`, 0.5 s by default), 120 steps per run, 20 ms of "compute" per micro-batch. Each run
has one event at step 60:

- `none`: nothing (the reference: the longest gap between two micro-batches of a rank);
- `worker_kill`: one worker process SIGKILLed;
- `poison_kill`: the next records of the JSONL source kill every process that reads them
  (`MSD_KILL_RECORDS`), so 3 workers die on each before it is quarantined;
- `pause`: every rank stops reading for `--pause-s` (a checkpoint save);
- `takeover`: the primary coordinator SIGKILLed, a standby on the same state dir takes over;
- `full_disk`: the state dir's disk (a tmpfs the tool mounts; needs root) full for `--pause-s`.

Per run: the longest wait of a rank for its next micro-batch at or after the event, minus the
event's own length (the pause, the full disk) and minus the reference run's longest wait: the
stall the event adds. Medians over `--repeats` runs, with min and max. For `takeover`, also how
long after the kill the standby held the lease (from its log).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402  (tools/ is on the path when run as a script)
from msd.testing.local import LocalJob  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402

SPAWN = mp.get_context("spawn")
STEPS = 120
EVENT_STEP = 60
COMPUTE_S = 0.02
EVENTS = ("none", "worker_kill", "poison_kill", "pause", "takeover", "full_disk")


def make_job(root: str, heartbeat_s: float) -> str:
    rng = np.random.default_rng(0)
    lengths = np.clip((rng.pareto(1.5, 5_000) * 300 + 50).astype(int), 50, 20_000)
    prefix = os.path.join(root, "tokens_text_document")
    write_megatron(prefix, (rng.integers(0, 50_000, n, dtype=np.uint16) for n in lengths), np.uint16)
    words = ["data", "loader", "token", "batch", "rank", "worker", "plan", "step", "merge", "shard"]
    with open(os.path.join(root, "text.jsonl"), "wb") as f:
        for i in range(5_000):
            f.write(orjson.dumps({"text": " ".join(rng.choice(words, int(rng.integers(20, 400))).tolist())}) + b"\n")
    job = {
        "seed": 3,
        "sources": {"tokens": {"format": "megatron", "paths": [prefix]},
                    "text": {"format": "jsonl", "paths": ["text.jsonl"]}},
        "batch": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"tokens": 0.5, "text": 0.5}},
        "runtime": {"heartbeat_s": heartbeat_s, "lookahead_steps": 3, "prepare_batch": 32},
    }
    path = os.path.join(root, "events.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def _rank(address: str, rank: int, pause: tuple[int, float] | None, out) -> None:
    """A trainer rank: receives STEPS steps, spending COMPUTE_S per micro-batch (and the pause after
    the given step); reports when each micro-batch arrived."""
    from trainer_client import DataClient

    arrivals = []
    with DataClient(address, rank=rank, as_torch=False, timeout_s=120) as client:
        for batch in client:
            arrivals.append((batch["step"], time.time()))
            if rank == 0 and batch["step"] == EVENT_STEP and batch["micro_batch"] == 0:
                out.put(("reached", arrivals[-1][1]))
            time.sleep(COMPUTE_S)
            if pause is not None and batch["step"] == pause[0] and batch["micro_batch"] == 0:
                time.sleep(pause[1])
            if batch["step"] + 1 >= STEPS and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
                break
    out.put((rank, arrivals))


def _logged_at(text: str, words: str) -> float | None:
    line = next((line for line in text.splitlines() if words in line), None)
    if line is None:
        return None
    return datetime.datetime.strptime(re.match(r"(\S+ \S+)", line).group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


def run_once(path: str, event: str, pause_s: float, root: str) -> dict:
    state = os.path.join(root, f"state-{event}")
    log = os.path.join(root, f"{event}-{time.monotonic_ns()}.log")
    mount = None
    if os.path.isdir(state) and event != "none":
        shutil.rmtree(state)
    if event == "none" and os.path.isdir(state):
        state = os.path.join(root, f"state-none-{time.monotonic_ns()}")  # the first one is the reference
    if event == "full_disk":
        mount = os.path.join(root, f"disk-{time.monotonic_ns()}")
        os.makedirs(mount)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mount], check=True)
        state = os.path.join(mount, "state")
    if event == "poison_kill":
        records = _records_near_event(path, os.path.join(root, "state-none"))
        os.environ["MSD_KILL_RECORDS"] = ",".join(f"text:{r}" for r in records)
    try:
        with LocalJob(path, workers=2, log_path=log, log_level="INFO", state_dir=state,
                      standby=event == "takeover") as job:
            out = SPAWN.Queue()
            pause = (EVENT_STEP, pause_s) if event == "pause" else None
            ranks = [SPAWN.Process(target=_rank, args=(job.address, r, pause, out)) for r in range(2)]
            for p in ranks:
                p.start()
            got = []
            while True:  # rank 0 says when it reached the event step
                item = out.get(timeout=300)
                if item[0] == "reached":
                    break
                got.append(item)
            event_at = _inject(job, event, pause_s, mount) if event != "pause" else item[1]
            arrivals = dict(got + [out.get(timeout=300) for _ in range(len(ranks) - len(got))])
            for p in ranks:
                p.join(10)
    finally:
        os.environ.pop("MSD_KILL_RECORDS", None)
        if mount is not None:
            subprocess.run(["umount", "-l", mount], check=False)
    if event == "none":
        event_at = min(t for a in arrivals.values() for s, t in a if s >= EVENT_STEP)
    waits = []
    for a in arrivals.values():
        times = [t for _, t in a]
        waits.append(max(b - max(prev, event_at) for prev, b in zip(times, times[1:]) if b >= event_at))
    text = open(log).read()
    result = {"longest_wait_s": round(max(waits), 3), "event_s": pause_s if event in ("pause", "full_disk") else 0.0}
    if event == "takeover":
        took = _logged_at(text, "with token 2")
        result["lease_taken_after_s"] = round(took - event_at, 3) if took else None
    if event == "poison_kill":
        result["quarantined"] = text.count("quarantined:")
        result["worker_deaths"] = text.count("names this record")
    return result


def _records_near_event(path: str, reference_state: str) -> list[int]:
    """Two JSONL records the plan uses just after the event step (read from the step journal of
    the reference run: the stream is the same in every run)."""
    from msd_common.spec import load_job
    from coordinator.plan import Planner
    from coordinator.sources import open_sources

    job = load_job(path)
    planner = Planner(job, open_sources(job).num_records)
    text = job.source("text").index
    cursor = None
    with open(os.path.join(reference_state, "steps.journal"), "rb") as f:
        for line in f:
            state = orjson.loads(line)["state"]
            if state["next_step"] == EVENT_STEP + 3:
                cursor = state["cursors"][text]
    return [int(r) for r in planner.streams[text].records_array(cursor, 2)]


def _inject(job: LocalJob, event: str, pause_s: float, mount: str | None) -> float:
    """Cause the event now; returns when."""
    now = time.time()
    if event == "worker_kill":
        os.kill(job.worker_pids()[0], signal.SIGKILL)
    elif event == "takeover":
        job.coordinator.kill()
    elif event == "full_disk":
        filler = os.path.join(mount, "filler")
        with open(filler, "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        threading.Timer(pause_s, os.unlink, (filler,)).start()
    return now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--pause-s", type=float, default=5.0)
    ap.add_argument("--events", default=",".join(EVENTS))
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="msd-events-")
    path = make_job(root, args.heartbeat_s)
    events = args.events.split(",")
    if "poison_kill" in events and "none" not in events:
        events.insert(0, "none")  # its journal says which records the event's steps read
    runs: dict[str, list[dict]] = {e: [] for e in events}
    for _ in range(args.repeats):  # interleaved, so the machine's noise falls on every event alike
        for event in events:
            runs[event].append(run_once(path, event, args.pause_s, root))
    reference = statistics.median(r["longest_wait_s"] for r in runs.get("none", [{"longest_wait_s": 0.0}]))
    summary = {}
    for event, rs in runs.items():
        stalls = [r["longest_wait_s"] - r["event_s"] - reference for r in rs]
        summary[event] = {"stall_s_median": round(statistics.median(stalls), 3), "stall_s_min": round(min(stalls), 3),
                          "stall_s_max": round(max(stalls), 3)}
        if event == "takeover":
            taken = [r["lease_taken_after_s"] for r in rs if r.get("lease_taken_after_s") is not None]
            summary[event]["lease_taken_after_s_median"] = round(statistics.median(taken), 3) if taken else None
    emit({"benchmark": "events", "steps": STEPS, "event_step": EVENT_STEP, "heartbeat_s": args.heartbeat_s,
          "pause_s": args.pause_s, "compute_s_per_micro_batch": COMPUTE_S, "reference_longest_wait_s": reference,
          "summary": summary, "runs": runs}, args.json)


if __name__ == "__main__":
    main()
