"""Time inside `DataClient.__next__` for vision-language micro-batches, the data already in:
Qwen2.5-VL samples whose images arrive as float32 pixel values (as before issue 59) or as uint8
frames that the client finishes into the same pixel values (issue 59).

    python tools/bench_next_vlm.py --json OUT [--compute-ms 0,100] [--micro-batches 60] [--rounds 3] [--ranks 1]

As tools/bench_next.py: a real DataClient whose finished steps are put on its hand-over queue
directly (nothing arrives over sockets). Steps of 4 micro-batches of one 8,192-token row, filled
with conversations of 1 to 3 images (patch grids of 16 to 46 patches a side, 300 text tokens
each). The trainer takes a micro-batch, "computes" (sleeps --compute-ms), drops it, takes the next.

Designs, alternated round by round:
- `float`: each sample carries its float32 `pixel_values` [patches, 1176] (the wire before issue 59);
- `frames`: each sample carries uint8 frames and its recipe; the client makes `pixel_values` (the
  builder thread ahead of `next()` when it can, on the CPU);
- `frames_device` (where a CUDA device exists): the same with `DataClient(device="cuda")`, the
  float work at `next()` on the GPU.
Figures: median and p90 of the time inside `next()` in milliseconds, pixel MB per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_output import emit  # noqa: E402

from msd.testing.ports import free_port  # noqa: E402
from msd_common.frames import FRAMES, RECIPE, FrameRecipe  # noqa: E402
from trainer_client import DataClient  # noqa: E402
from trainer_client.assemble import StepAssembler  # noqa: E402
from trainer_client.receiving import ReadyStep  # noqa: E402

MICRO_BATCHES = 4
ROW = 8192
INFO = {"topology": {"dp": 1, "pp": 1, "cp": 1, "tp": 1}, "pad_id": 0, "micro_batch_size": 1,
        "micro_batches": MICRO_BATCHES}
PATCH, MERGE, TEMPORAL = 14, 2, 2
RECIPE_ARRAY = FrameRecipe("qwen_patches", "pil", True, 1 / 255, True, (0.48145466, 0.4578275, 0.40821073),
                           (0.26862954, 0.26130258, 0.27577711), PATCH, MERGE, TEMPORAL).to_array()


def vlm_step(step: int, design: str, rng: np.random.Generator) -> ReadyStep:
    """A finished step of one rank: rows of Qwen2.5-VL conversations, their arrays in."""
    refs, counts, samples, key = [], [], [], step << 20
    for _ in range(MICRO_BATCHES):
        left, n = ROW, 0
        while True:
            grids = np.array([(1, 2 * rng.integers(8, 24), 2 * rng.integers(8, 24)) for _ in range(rng.integers(1, 4))])
            length = int(grids.prod(axis=1).sum()) // (MERGE * MERGE) + 300
            if length > left:
                break
            refs.append((key, 0, length))
            samples.append(grids)
            key, left, n = key + 1, left - length, n + 1
        counts.append(n)
    refs_a = np.array(refs, dtype=np.uint64)
    assembler = StepAssembler(refs_a, np.array(counts), ROW, 0, 1, rope="plain")
    items = np.column_stack([np.arange(len(refs_a), dtype=np.uint64), refs_a])
    if design == "float":
        extras = [["pixel_values", "<f4", [3 * TEMPORAL * PATCH * PATCH], 0], ["image_grid_thw", "<i8", [3], 0]]
    else:
        extras = [[FRAMES, "|u1", [], 0], [RECIPE, "<f8", [], 0], ["image_grid_thw", "<i8", [3], 0]]
    rows, frames = [], []
    for grids in samples:
        patches = int(grids.prod(axis=1).sum())
        if design == "float":
            pixels = rng.standard_normal((patches, 3 * TEMPORAL * PATCH * PATCH), dtype=np.float32)
            rows.append([patches, len(grids)])
            frames += [pixels.view(np.uint8).reshape(-1), grids.astype(np.int64).view(np.uint8).reshape(-1)]
        else:
            pixels = rng.integers(0, 256, patches * 3 * PATCH * PATCH, dtype=np.uint8)
            rows.append([len(pixels), len(RECIPE_ARRAY), len(grids)])
            frames += [pixels, RECIPE_ARRAY.view(np.uint8), grids.astype(np.int64).view(np.uint8).reshape(-1)]
    assembler.add(items, rng.integers(0, 65_000, int(refs_a[:, 2].sum())).astype(np.uint16), extras=extras,
                  extra_rows=np.array(rows, np.int64), extra_frames=frames)
    return ReadyStep(step, 0, assembler, {}, 0, INFO, False)


def run(design: str, compute_s: float, micro_batches: int, barrier: tuple[str, int] | None = None) -> dict:
    """barrier (folder, ranks): with other trainer processes, each starts taking micro-batches once
    all of them have their steps in (a file each in the folder)."""
    device = "cuda" if design == "frames_device" else None
    client = DataClient(f"tcp://127.0.0.1:{free_port()}", rank=0, timeout_s=30, device=device)
    client.start()
    rng = np.random.default_rng(7)
    steps = -(-(micro_batches + 4) // MICRO_BATCHES)
    for s in range(steps):  # every step is in before the first is taken: the data has arrived
        client._queue.put(vlm_step(s, "float" if design == "float" else "frames", rng))
    if barrier is not None:
        folder, ranks = barrier
        open(os.path.join(folder, str(os.getpid())), "w").close()
        while len(os.listdir(folder)) < ranks:
            time.sleep(0.005)
    times, pixel_mb = [], []
    try:
        for _ in range(micro_batches + 4):
            t0 = time.perf_counter()
            batch = next(client)
            times.append(time.perf_counter() - t0)
            pixel_mb.append(batch["pixel_values"].nbytes / 2**20)
            if compute_s:
                time.sleep(compute_s)
            del batch
    finally:
        client.close()
    ms = np.array(times[4:]) * 1e3  # the first 4: warm-up
    return {"design": design, "compute_ms": compute_s * 1e3, "micro_batches": len(ms),
            "median_ms": float(np.median(ms)), "p90_ms": float(np.percentile(ms, 90)),
            "pixel_mb_per_micro_batch": float(np.median(pixel_mb))}


def on_ranks(design: str, compute_ms: float, micro_batches: int, ranks: int) -> dict:
    """One round on `ranks` trainer processes at once: the median and p90 over all their calls
    (each rank's own medians kept), as one host's ranks share its cores and memory bandwidth."""
    with tempfile.TemporaryDirectory() as folder:
        procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--micro-batches", str(micro_batches),
                                   "--one", design, str(compute_ms), folder, str(ranks)],
                                  stdout=subprocess.PIPE, text=True) for _ in range(ranks)]
        outs = [json.loads(p.communicate(timeout=1800)[0].strip().splitlines()[-1]) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a rank of the {design} round failed")
    return {"design": design, "compute_ms": compute_ms, "ranks": ranks,
            "micro_batches": sum(o["micro_batches"] for o in outs),
            "median_ms": float(statistics.median(o["median_ms"] for o in outs)),
            "p90_ms": float(statistics.median(o["p90_ms"] for o in outs)),
            "per_rank_median_ms": [o["median_ms"] for o in outs],
            "pixel_mb_per_micro_batch": outs[0]["pixel_mb_per_micro_batch"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--compute-ms", default="0,100")
    ap.add_argument("--micro-batches", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=1, help="trainer processes taking micro-batches at once, "
                    "as the ranks of one host do (each its own client; the figures are over all of them)")
    ap.add_argument("--one", nargs=4, metavar=("DESIGN", "COMPUTE_MS", "BARRIER", "RANKS"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    logging.getLogger("msd.session").setLevel(logging.ERROR)  # the coordinator is a closed port on purpose
    if a.one:  # one rank of a --ranks round: its result on stdout
        design, compute_ms, folder, ranks = a.one
        print(json.dumps(run(design, float(compute_ms) / 1e3, a.micro_batches, (folder, int(ranks)))))
        return
    import torch

    designs = ["float", "frames"] + (["frames_device"] if torch.cuda.is_available() else [])
    results: dict[str, list[dict]] = {}
    for compute_ms in (float(c) for c in a.compute_ms.split(",")):
        for r in range(a.rounds):
            for design in designs if r % 2 == 0 else designs[::-1]:
                out = run(design, compute_ms / 1e3, a.micro_batches) if a.ranks == 1 else \
                    on_ranks(design, compute_ms, a.micro_batches, a.ranks)
                results.setdefault(f"{design}@{compute_ms:g}ms", []).append(out)
                print(f"# {compute_ms:g} ms, {design}, round {r}: median {out['median_ms']:.2f} ms, "
                      f"p90 {out['p90_ms']:.2f}", file=sys.stderr, flush=True)
    summary = {k: {"median_ms": statistics.median(x["median_ms"] for x in v),
                   "median_ms_min": min(x["median_ms"] for x in v), "median_ms_max": max(x["median_ms"] for x in v),
                   "p90_ms": statistics.median(x["p90_ms"] for x in v),
                   "pixel_mb_per_micro_batch": v[0]["pixel_mb_per_micro_batch"]} for k, v in results.items()}
    emit({"benchmark": "next_vlm", "command": "python tools/bench_next_vlm.py " + " ".join(sys.argv[1:]),
          "cpus": os.cpu_count(), "ranks": a.ranks,
          "device": "measured" if len(designs) == 3 else "no CUDA device: not measured",
          "summary": summary, "rounds": results}, a.json)


if __name__ == "__main__":
    main()
