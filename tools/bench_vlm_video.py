"""Video conversations through msd and through Megatron-Energon (its AVDecoder), with the same
processor (Qwen2.5-VL's, transformers' own classes), each loader on the data in its own format: msd
a JSONL file of conversations whose video parts name MP4 files beside it; Energon WebDataset shards
(a JSON conversation and its MP4 per sample) prepared with `energon prepare`, read through a
CrudeWebdataset and tools/bench_vlm_energon.py's TaskEncoder, which decodes each video with
Energon's AVDecoder (`get_single_frames_uniform`: as many frames, spread evenly, as the processor
samples at --fps) and gives the frames to the processor.

    python tools/bench_vlm_video.py --json OUT [--records 300] [--samples 220] [--rounds 3]

msd: `msd coordinator --worker-procs 1` and a DataClient in one process of the reference
environment (.venv-vlm: transformers' video processors are torchvision code; the worker decodes
the sampled frames with PyAV and sends them as uint8, the client finishes them); Energon:
get_loader with num_workers=1, in the same environment. Both are one rank with one worker process
and no trainer compute, the loaders alternated over --rounds rounds (medians, with min and max):
samples per second after the first batch, bytes a sample on the wire (msd), the trainer process's
PSS growth and its anonymous and shared memory's (RssAnon + RssShmem), the pixel values it holds at
the end, the loader processes' PSS, time to
the first batch (msd), padding. bench_vlm.py measures balance, with images.

The videos: H.264 MP4s of 2 to 8 seconds at 24 or 30 frames a second, 160 to 480 pixels a side
(tests/vlm/video_check.write_video: a moving block over a drifting colour and noise), one a
conversation with a question and an answer.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(1, os.path.join(ROOT, "tools"))

from bench_output import emit  # noqa: E402
from e2e_ranks import over_run_mb  # noqa: E402

VLM_PYTHON = os.environ.get("MSD_ENERGON_PYTHON", os.path.join(ROOT, ".venv-vlm", "bin", "python"))
SEQ_LEN = 8192
FRAME_PIXELS = 160 * 28 * 28  # the video processor's pixel budget a frame (lowered from the published one)


def write_videos(root: str, records: int, seed: int = 0) -> None:
    """In the reference environment (PyAV): ROOT/msd/conversations.jsonl and its clips, and the same
    conversations as Energon's WebDataset shards in ROOT/energon."""
    import numpy as np
    import orjson

    from msd.testing.chat_data import WORDS
    from tests.vlm.video_check import write_video

    from bench_vlm import add_sample, open_shards

    rng, sizes = random.Random(seed), np.random.default_rng(seed)
    msd_dir, _, shards = open_shards(root, "clips")
    with open(os.path.join(msd_dir, "conversations.jsonl"), "wb") as jsonl:
        for i in range(records):
            path = os.path.join(msd_dir, "clips", f"{i:06d}.mp4")
            fps = rng.choice([24, 30])
            write_video(path, fps * rng.randint(2, 8), fps, 16 * int(sizes.integers(10, 31)),
                        16 * int(sizes.integers(10, 31)), "libx264")
            messages = [{"role": "user", "content": [
                            {"type": "video", "video": "0.mp4"},
                            {"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))}]},
                        {"role": "assistant", "content": [
                            {"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(5, 120)))}]}]
            mine = [{**m, "content": [{**p, "video": f"clips/{i:06d}.mp4"} if p["type"] == "video" else p
                                      for p in m["content"]]} for m in messages]
            jsonl.write(orjson.dumps({"messages": mine}) + b"\n")
            with open(path, "rb") as f:
                video = f.read()
            add_sample(shards[i % len(shards)], i, [("json", orjson.dumps({"messages": messages})), ("0.mp4", video)])
    for tar in shards:
        tar.close()


def msd_round(root: str, processor: str, samples: int, pad_id: int, fps: float) -> dict:
    """One msd round, in this process (the reference environment)."""
    from bench_vlm import msd_throughput

    jsonl = os.path.join(root, "msd", "conversations.jsonl")
    return msd_throughput(root, processor, jsonl, samples, pad_id, source={"video_fps": fps})


def in_reference(*args: str) -> dict:
    """This script's or bench_vlm_energon.py's answer, run in the reference environment."""
    out = subprocess.run([VLM_PYTHON, *args], capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "PYTHONPATH": ROOT})
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import statistics

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--records", type=int, default=300)
    ap.add_argument("--samples", type=int, default=220, help="samples timed a round (fewer than --records, and "
                    "far more than the steps delivered ahead hold)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fps", type=float, default=2.0, help="frames sampled a second of video")
    ap.add_argument("--write", nargs=2, metavar=("ROOT", "RECORDS"), help=argparse.SUPPRESS)
    ap.add_argument("--msd-round", nargs=4, metavar=("ROOT", "PROCESSOR", "SAMPLES", "PAD_ID"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write:
        write_videos(args.write[0], int(args.write[1]))
        print("{}")
        return
    if args.msd_round:
        root, processor, samples, pad_id = args.msd_round
        print(json.dumps(msd_round(root, processor, int(samples), int(pad_id), args.fps)))
        return

    from tokenizers import Tokenizer

    from bench_vlm import energon_prepare
    from msd.testing.vlm_data import write_qwen2_5_vl_processor, write_video_config

    if not os.path.exists(VLM_PYTHON):
        sys.exit(f"no reference environment at {VLM_PYTHON}: run `make bench-vlm-env`")
    root = tempfile.mkdtemp(prefix="msd-bench-vlm-video-")
    started = time.perf_counter()
    processor = write_qwen2_5_vl_processor(os.path.join(root, "qwen-vl"), vocab_size=2000)
    write_video_config(processor, "qwen2_5_vl", FRAME_PIXELS, fps=args.fps)
    in_reference(os.path.abspath(__file__), "--write", root, str(args.records))
    energon_prepare(os.path.join(root, "energon"))
    pad_id = Tokenizer.from_file(os.path.join(processor, "tokenizer.json")).token_to_id("<|endoftext|>")
    result: dict = {"records": args.records, "seq_len": SEQ_LEN, "fps": args.fps, "frame_pixels": FRAME_PIXELS,
                    "data_s": time.perf_counter() - started}
    rounds: dict[str, list[dict]] = {"msd": [], "energon": []}
    for r in range(args.rounds):
        for design in (list(rounds) if r % 2 == 0 else list(rounds)[::-1]):
            if design == "msd":
                run = in_reference(os.path.abspath(__file__), "--fps", str(args.fps), "--msd-round", root, processor,
                                   str(args.samples), str(pad_id))
            else:
                run = in_reference(os.path.join(ROOT, "tools", "bench_vlm_energon.py"), "throughput",
                                   os.path.join(root, "energon"), processor, "--seq-len", str(SEQ_LEN), "--samples",
                                   str(args.samples), "--workers", "1", "--video-fps", str(args.fps))
                run["memory_kb"]["loader_processes"] = run["memory_kb"].pop("workers")
            rounds[design].append(run)
            print(f"# round {r} {design}: {run['samples_per_s_per_worker']:.2f} samples/s", file=sys.stderr)

    def spread(values: list[float]) -> dict:
        return {"median": statistics.median(values), "min": min(values), "max": max(values)}

    for design, runs in rounds.items():
        memory = {k: spread([x["memory_kb"][k] / 1024 for x in runs])
                  for k in ("loader_processes", "trainer_growth", "trainer_anon_shmem_growth", "held_pixel_values")}
        # sampled every 20 ms over the timed part of a round (the peak above the baseline, and above
        # where the timed part began); and the kernel's exact high-water mark of the resident set
        for k, values in over_run_mb(runs).items():
            memory[f"trainer_anon_shmem_{k}"] = spread(values)
        result[design] = {"samples_per_s_per_worker": spread([x["samples_per_s_per_worker"] for x in runs]),
                          "memory_mb": memory, "padding": spread([x["padding"] for x in runs])}
        for key in ("first_batch_s", "wire_bytes_per_sample", "next_ms"):
            if key in runs[0]:
                result[design][key] = spread([x[key] for x in runs])
    result["throughput_ratio"] = (result["msd"]["samples_per_s_per_worker"]["median"]
                                  / result["energon"]["samples_per_s_per_worker"]["median"])
    emit(result, args.json)


if __name__ == "__main__":
    main()
