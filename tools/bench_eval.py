"""Evaluation passes: time for one pass over a held-out set, and what passes cost training.

    python tools/bench_eval.py [--records 60000] [--held-out 10000] [--ranks 2 8] [--json OUT]

A JSONL corpus of `--records` documents (byte tokenizer, 100 to 900 bytes each) with an eval set
holding out `--held-out` of them (`eval: {heldout: {holdout: {text: N}}}`), 2 worker processes,
rows of 1,024 tokens, 2 micro-batches a step per rank. For each rank count:
- the pass: every rank asks for one pass (`client.eval_batches`) after step 3; the time from the
  first request to the last rank's last micro-batch, for the first pass (records prepared then)
  and a second (prepared again), and the micro-batches per rank;
- training: the median time per step (10 ms of compute per micro-batch, as bench_e2e's ranks
  sleep) over steps 4..23, in a run without evaluation and in one with a pass after every 5th
  step (the pass's own time left out), alternated.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time

import orjson
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_output import emit  # noqa: E402
from msd.testing.local import LocalJob  # noqa: E402

SPAWN = mp.get_context("spawn")
WORDS = "the loader plans every global batch from sample metadata and balances cost across ranks".split()


def make_corpus(path: str, n: int) -> None:
    if os.path.exists(path):
        return
    rng = random.Random(0)
    with open(path + ".tmp", "wb") as f:
        for _ in range(n):
            f.write(orjson.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(15, 140)))}) + b"\n")
    os.replace(path + ".tmp", path)


def write_job(root: str, ranks: int, held_out: int) -> str:
    job = {"seed": 5, "sources": {"text": {"format": "jsonl", "paths": ["corpus.jsonl"]}},
           "batch": {"seq_len": 1024, "micro_batch_size": 1, "global_batch_size": 2 * ranks},
           "topology": {"dp": ranks}, "mixture": {"weights": {"text": 1.0}},
           "eval": {"heldout": {"holdout": {"text": held_out}}},
           "runtime": {"heartbeat_s": 1.0, "prepare_batch": 64}}
    path = os.path.join(root, f"job-{ranks}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f)
    return path


def _rank(address: str, rank: int, steps: int, eval_every: int, passes_at: int, out) -> None:
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=False, timeout_s=600)
    step_times, pass_times, micro_batches = [], [], 0
    last = None
    for batch in client:
        time.sleep(0.01)
        if batch["micro_batch"] != client.micro_batches_per_step - 1:
            continue
        step = batch["step"]
        now = time.perf_counter()
        if last is not None and 4 <= step:
            step_times.append(now - last)
        if step == passes_at:
            for _ in range(2):
                started = time.time()
                micro_batches = sum(1 for _ in client.eval_batches("heldout"))
                pass_times.append((started, time.time()))
        elif eval_every and step > passes_at and step % eval_every == 0:
            for _ in client.eval_batches("heldout"):
                pass
        last = time.perf_counter()  # a pass's own time is left out of the next step's
        if step + 1 >= steps:
            break
    client.close()
    out.put((rank, step_times, pass_times, micro_batches))


def run(path: str, ranks: int, steps: int, eval_every: int, passes_at: int) -> dict:
    with LocalJob(path, workers=2) as cluster:
        out = SPAWN.Queue()
        procs = [SPAWN.Process(target=_rank, args=(cluster.address, r, steps, eval_every, passes_at, out))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        results = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(30)
    step_s = statistics.median(t for r in results for t in r[1])
    out = {"step_s_median": round(step_s, 4)}
    if passes_at < steps:
        for i, name in enumerate(("first_pass_s", "second_pass_s")):
            out[name] = round(max(r[2][i][1] for r in results) - min(r[2][i][0] for r in results), 3)
        out["micro_batches_per_rank"] = results[0][3]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=60000)
    ap.add_argument("--held-out", type=int, default=10000)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 8])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "msd-bench-eval"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    os.makedirs(args.data_dir, exist_ok=True)
    make_corpus(os.path.join(args.data_dir, "corpus.jsonl"), args.records)
    result = {"benchmark": "eval", "command": "python tools/bench_eval.py " + " ".join(sys.argv[1:]),
              "records": args.records, "held_out": args.held_out, "cpus": os.cpu_count(), "ranks": {}}
    for ranks in args.ranks:
        path = write_job(args.data_dir, ranks, args.held_out)
        passes = run(path, ranks, args.steps, 0, 3)
        without, with_passes = [], []
        for _ in range(args.repeats):  # alternated
            without.append(run(path, ranks, args.steps, 0, args.steps)["step_s_median"])
            with_passes.append(run(path, ranks, args.steps, 5, 4)["step_s_median"])
        result["ranks"][str(ranks)] = {**passes, "training_step_s_without_eval": without,
                                       "training_step_s_with_eval_every_5": with_passes}
        print(f"# {ranks} ranks: {result['ranks'][str(ranks)]}", file=sys.stderr)
    emit(result, args.json)


if __name__ == "__main__":
    main()
