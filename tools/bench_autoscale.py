"""Worker allocation across sources of very different cost: a fixed equal split against ours.

    python tools/bench_autoscale.py --json OUT [--steps N] [--repeats R] [--workers W]

One job, two sources: `text`, pre-tokenized Megatron (reading is an index lookup and a memory
copy), and `images`, a WebDataset of JPEG/PNG/WebP image-text pairs (decode, resize to 224x224
pixels at most, cut into 14x14 patches, tokenize the caption), mixed 50/50 by tokens. The same
W worker processes serve it under
  (a) `runtime.allocation: fixed`: workers split equally among the sources, each serving one
      (the per-source loader design), and
  (b) `runtime.allocation: adaptive` (ours): any worker serves any source, tasks go by measured
      cost and queued work.
Two trainer ranks consume steps, spending --compute-ms per micro-batch (sleeping, as a GPU step
would leave the CPU free). Reported per design: trainer steps/s over the measured steps (after
a warm-up), and the share of time the ranks spent waiting for data (the DataClient's waited_s).
The per-token cost of each source: images from the coordinator's estimates (what workers report
for preparing them); text, which the coordinator prepares itself from the index, by timing the
worker's read of its tokens from the memory map here (text_s_per_token).
Runs alternate (a, b, a, b, ...); medians are compared. Top-level `ratio` = steps/s (b) / (a).

`--case slow-transform` (issue 32): the second source is the same Megatron text through a
deliberately slow transform of the user's own (`msd.testing.transforms:busy`,
`--transform-ms` of CPU per record): a transform's time is part of its source's measured cost,
so adaptive allocation gives that source the workers it needs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_output import emit  # noqa: E402  (tools/ is on the path when run as a script)

from msd.testing.local import LocalJob  # noqa: E402
from msd.testing.multimodal_data import captions, write_webdataset  # noqa: E402
from worker.samples import open_source  # noqa: E402
from msd_common.formats.megatron import write_megatron  # noqa: E402
from msd_common.tokenizer import ByteTokenizer  # noqa: E402

SPAWN = mp.get_context("spawn")
DATA_VERSION = 1


def make_data(root: str, images: int) -> None:
    stamp = os.path.join(root, f".complete-v{DATA_VERSION}-{images}")
    if os.path.exists(stamp):
        return
    os.makedirs(os.path.join(root, "images"), exist_ok=True)
    per_shard = 100
    for shard in range(-(-images // per_shard)):
        write_webdataset(os.path.join(root, "images", f"img-{shard:03d}.tar"), min(per_shard,
                                                                                   images - shard * per_shard),
                         seed=shard, sizes=(320, 800), formats=("jpg", "jpg", "png", "webp"))
    tok = ByteTokenizer()
    texts = captions()
    write_megatron(os.path.join(root, "text_document"), (tok.encode(" ".join(texts[i: i + 8]))
                                                          for i in range(0, len(texts) - 8, 3)), np.uint16)
    open(stamp, "w").close()


def write_job(root: str, allocation: str, seq_len: int, ranks: int, case: str = "images",
              transform_ms: float = 2.0) -> str:
    second = {"images": {"format": "webdataset", "paths": ["images/*.tar"], "image_token_id": 300,
                         "max_pixels": 224 * 224, "patch_size": 14}}
    if case == "slow-transform":
        second = {"slow": {"format": "megatron", "paths": ["text_document"],
                             "transform": "msd.testing.transforms:busy", "transform_args": {"ms": transform_ms}}}
    job = {
        "seed": 11,
        "sources": {
            "text": {"format": "megatron", "paths": ["text_document"]},
            **second,
        },
        "batch": {"seq_len": seq_len, "micro_batch_size": 1, "global_batch_size": 2 * ranks},
        "topology": {"dp": ranks},
        "mixture": {"weights": {"text": 0.5, next(iter(second)): 0.5}},
        "balance": {"cost": {"quadratic": 1.0, "linear": 0.0, "patch_quadratic": 1.0, "patch_linear": 0.0}},
        "runtime": {"allocation": allocation, "prepare_batch": 8, "lookahead_steps": 4, "heartbeat_s": 0.5,
                    "status_every_s": 1.0},
    }
    path = os.path.join(root, f"job-{allocation}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


def _rank(address: str, rank: int, steps: int, warmup: int, compute_s: float, out) -> None:
    from trainer_client import DataClient

    client = DataClient(address, rank=rank, as_torch=False, timeout_s=120)
    start = waited_at_start = None
    for batch in client:
        if batch["step"] == warmup and batch["micro_batch"] == 0:
            start, waited_at_start = time.perf_counter(), client.waited_s
        time.sleep(compute_s)
        if batch["step"] + 1 >= warmup + steps and batch["micro_batch"] == client.batch_info["micro_batches"] - 1:
            break
    elapsed = time.perf_counter() - start
    out.put((rank, elapsed, client.waited_s - waited_at_start))
    client.close()


def run_once(job_path: str, workers: int, ranks: int, steps: int, warmup: int, compute_s: float,
             state_dir: str) -> dict:
    with LocalJob(job_path, workers=workers, state_dir=state_dir) as cluster:
        out = SPAWN.Queue()
        procs = [SPAWN.Process(target=_rank, args=(cluster.address, r, steps, warmup, compute_s, out))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        results = [out.get(timeout=600) for _ in procs]
        for p in procs:
            p.join(30)
        time.sleep(1.2)  # one more status write with the final cost estimates
        status = _read_status(state_dir)
    elapsed = max(r[1] for r in results)
    return {
        "steps_per_s": steps / elapsed,
        "data_wait_share": max(r[2] for r in results) / elapsed,
        "source_s_per_token": {k: v["s_per_token"] for k, v in status.get("source_cost", {}).items()},
    }


def text_s_per_token(root: str) -> float:
    """Seconds per token a worker spends reading the text source's pieces from the memory map
    (SourceReader.gather, as at delivery), in batches of 64 whole documents; best of 3 passes."""
    reader = open_source({"name": "text", "format": "megatron", "files": [os.path.join(root, "text_document")]})
    records = np.arange(reader.num_records)
    lengths = reader.lengths(records)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for lo in range(0, len(records), 64):
            batch = slice(lo, lo + 64)
            reader.gather(records[batch], np.zeros_like(records[batch]), lengths[batch])
        best = min(best, time.perf_counter() - started)
    return best / int(lengths.sum())


def _read_status(state_dir: str) -> dict:
    import orjson

    try:
        with open(os.path.join(state_dir, "status.json"), "rb") as f:
            return orjson.loads(f.read())
    except (OSError, ValueError):
        return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--compute-ms", type=float, default=5.0)
    ap.add_argument("--images", type=int, default=400)
    ap.add_argument("--case", choices=("images", "slow-transform"), default="images",
                    help="the second source: image-text samples, or text through a slow transform")
    ap.add_argument("--transform-ms", type=float, default=2.0, help="--case slow-transform: CPU ms per record")
    ap.add_argument("--data-dir", default=os.path.join(os.environ.get("MSD_CACHE_DIR") or
                                                       os.path.expanduser("~/.cache/megascale-data"),
                                                       "bench-autoscale"))
    args = ap.parse_args()
    make_data(args.data_dir, args.images)
    runs: dict[str, list[dict]] = {"fixed": [], "adaptive": []}
    for i in range(args.repeats):
        for allocation in ("fixed", "adaptive"):
            job = write_job(args.data_dir, allocation, args.seq_len, args.ranks, args.case, args.transform_ms)
            state = os.path.join(args.data_dir, f"state-{allocation}-{os.getpid()}-{i}")
            r = run_once(job, args.workers, args.ranks, args.steps, args.warmup, args.compute_ms / 1000, state)
            runs[allocation].append(r)
            print(f"# {allocation}: {r['steps_per_s']:.2f} steps/s, waiting {100 * r['data_wait_share']:.0f}%",
                  file=sys.stderr)

    def summary(rs: list[dict]) -> dict:
        return {
            "steps_per_s": statistics.median(r["steps_per_s"] for r in rs),
            "data_wait_share": statistics.median(r["data_wait_share"] for r in rs),
            "runs": rs,
        }

    fixed, adaptive = summary(runs["fixed"]), summary(runs["adaptive"])
    second = "slow" if args.case == "slow-transform" else "images"
    costs = {second: adaptive["runs"][-1]["source_s_per_token"].get(second),
             "text": text_s_per_token(args.data_dir)}
    result = {
        "benchmark": "autoscale", "case": args.case,
        "command": "python tools/bench_autoscale.py " + " ".join(sys.argv[1:]),
        "workers": args.workers, "ranks": args.ranks, "seq_len": args.seq_len, "steps": args.steps,
        "compute_ms_per_micro_batch": args.compute_ms, "cpus": os.cpu_count(),
        "source_s_per_token": costs,
        f"cost_ratio_{second}_over_text": (costs[second] / costs["text"]
                                           if costs.get(second) and costs.get("text") else None),
        "fixed": fixed,
        "adaptive": adaptive,
        "ratio": adaptive["steps_per_s"] / fixed["steps_per_s"],
    }
    emit(result, args.json)


if __name__ == "__main__":
    main()
