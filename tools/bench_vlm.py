"""Image conversations through msd and through Megatron-Energon, with the same processor
(Qwen2.5-VL's, transformers' own classes, PIL image backend), each loader on the data written in
its own format: msd a JSONL file of conversations beside a folder of JPEG images; Energon
WebDataset shards (a JSON conversation and its JPEG images per sample) prepared with `energon
prepare`, read through a CrudeWebdataset and a TaskEncoder (tools/bench_vlm_energon.py, run in
the environment `make bench-vlm-env` makes).

    python tools/bench_vlm.py --json OUT [--records 600] [--samples 400] [--rounds 3]

Throughput: samples per second of one rank with one worker process, after its first batch, the
loaders alternated over --rounds rounds (medians, with min and max). msd: `msd coordinator
--worker-procs 1` and a DataClient in this process, the job's runtime settings left at their
defaults (the image pass at delivery, planned from image sizes) and, as msd-prepare, with
`image_pass: prepare` (the processor run whole at prepare time); Energon: get_loader with
num_workers=1. Also msd's time from start to the first batch.
Memory: proportional set size (PSS) of every loader process (msd: the coordinator with its
worker host, fork server and worker; Energon: its worker process) plus the trainer process's PSS
growth since before its loader existed (torch imported in both), read at the end of a round.
Padding: the share of the rows' tokens that are padding.

Balance: per-rank cost (language model plus vision encoder) of the first --steps steps at 8 and
64 ranks, two micro-batches of one sequence each per rank and step, max over mean across the
ranks, averaged over the steps. Both loaders see the same records: each record's (tokens,
patches) is what the processor makes of one of the conversations (measured here), resampled to
--balance-records records. msd: the coordinator's planner (coordinator/plan.py, the code the
coordinator runs) over those lengths; Energon: each rank's own loader, packing inside itself
(encode_sample reads the measured lengths instead of running the processor). The cost, from the
FLOPs of Qwen2.5-VL-7B (language model 7.6e9 parameters, hidden 3584, 28 layers; vision encoder
0.67e9 parameters) in units of one attention token pair: a piece of n tokens and p patches costs
n^2 + 75,700 n + 6,680 p (linear FLOPs 6 x parameters per token or patch, attention 6 x hidden x
layers per token pair; the encoder's window attention is left out). msd plans with this cost.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

import numpy as np
import orjson

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# MSD_BENCH_TREE: another checkout whose msd runs a round (--baseline-tree; its commands get it on PYTHONPATH)
sys.path.insert(0, os.environ.get("MSD_BENCH_TREE", ROOT))
sys.path.insert(1, os.path.join(ROOT, "tools"))

from bench_output import emit  # noqa: E402

ENERGON_PYTHON = os.environ.get("MSD_ENERGON_PYTHON", os.path.join(ROOT, ".venv-vlm", "bin", "python"))
ENERGON_SCRIPT = os.path.join(ROOT, "tools", "bench_vlm_energon.py")
LM_LINEAR = 75_700.0  # 7.6e9 / (3584 x 28)
ENCODER_LINEAR = 6_680.0  # 0.67e9 / (3584 x 28)
SEQ_LEN = 8192
MICRO_BATCHES = 2


def piece_cost(tokens: np.ndarray, patches: np.ndarray) -> np.ndarray:
    tokens = np.asarray(tokens, np.float64)
    return tokens * tokens + LM_LINEAR * tokens + ENCODER_LINEAR * np.asarray(patches, np.float64)


# ---------------------------------------------------------------- the data, in each one's format


def write_data(root: str, records: int, seed: int = 0) -> tuple[str, str, str]:
    """(processor dir, msd's JSONL, Energon's dataset dir): the same conversations and JPEGs."""
    from PIL import Image

    from msd.testing.chat_data import WORDS
    from msd.testing.vlm_data import write_qwen2_5_vl_processor

    processor = write_qwen2_5_vl_processor(os.path.join(root, "qwen-vl"), vocab_size=2000)
    rng = random.Random(seed)
    pixels = np.random.default_rng(seed)
    msd_dir, energon_dir, shards = open_shards(root, "images")
    with open(os.path.join(msd_dir, "conversations.jsonl"), "wb") as jsonl:
        for i in range(records):
            messages, files = [], {}
            for turn in range(rng.randint(1, 3)):
                content = []
                for j in range(rng.randint(1 if turn == 0 else 0, 2)):
                    h, w = rng.randint(160, 640), rng.randint(160, 640)
                    # a smooth picture with some grain: JPEGs of the size real photos have
                    base = pixels.integers(0, 255, (h // 16 + 1, w // 16 + 1, 3), dtype=np.uint8)
                    big = np.kron(base, np.ones((16, 16, 1), np.uint8))[:h, :w]
                    big = np.clip(big.astype(np.int16) + pixels.integers(-12, 12, big.shape), 0, 255).astype(np.uint8)
                    buf = io.BytesIO()
                    Image.fromarray(big).save(buf, format="JPEG", quality=90)
                    name = f"{len(files)}.jpg"
                    files[name] = buf.getvalue()
                    content.append({"type": "image", "image": name})
                content.append({"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(5, 60)))})
                messages.append({"role": "user", "content": content})
                messages.append({"role": "assistant", "content": [
                    {"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(5, 120)))}]})
            for name, data in files.items():  # msd: images beside the JSONL, paths in the parts
                with open(os.path.join(msd_dir, "images", f"{i:06d}-{name}"), "wb") as f:
                    f.write(data)
            mine = [{**m, "content": [{**p, "image": f"images/{i:06d}-{p['image']}"} if p["type"] == "image" else p
                                      for p in m["content"]]} for m in messages]
            jsonl.write(orjson.dumps({"messages": mine}) + b"\n")
            # Energon: one WebDataset sample per conversation
            add_sample(shards[i % len(shards)], i, [("json", orjson.dumps({"messages": messages})), *files.items()])
    for tar in shards:
        tar.close()
    energon_prepare(energon_dir)
    return processor, os.path.join(msd_dir, "conversations.jsonl"), energon_dir


def open_shards(root: str, media: str, count: int = 4) -> tuple[str, str, list[tarfile.TarFile]]:
    """(msd's folder, its `media` folder made; Energon's folder; Energon's WebDataset shards, open)."""
    msd_dir, energon_dir = os.path.join(root, "msd"), os.path.join(root, "energon")
    os.makedirs(os.path.join(msd_dir, media))
    os.makedirs(energon_dir)
    return msd_dir, energon_dir, [tarfile.open(os.path.join(energon_dir, f"shard-{k:03d}.tar"), "w")
                                  for k in range(count)]


def add_sample(tar: tarfile.TarFile, i: int, entries: list[tuple[str, bytes]]) -> None:
    """Energon's WebDataset sample i: an entry a (suffix, bytes)."""
    for name, data in entries:
        info = tarfile.TarInfo(f"{i:06d}.{name}")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))


def energon_prepare(path: str) -> None:
    energon = os.path.join(os.path.dirname(ENERGON_PYTHON), "energon")
    subprocess.run([energon, "prepare", path, "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
                    "CrudeWebdataset", "--no-progress", "--force-overwrite"], check=True, stdout=subprocess.DEVNULL)


def write_keys_dataset(root: str, n: int) -> str:
    """Energon's balance dataset: n samples holding only their index (the lengths come from a table)."""
    os.makedirs(root)
    for k in range(8):
        with tarfile.open(os.path.join(root, f"keys-{k:03d}.tar"), "w") as tar:
            for i in range(k, n, 8):
                data = orjson.dumps({"i": i})
                info = tarfile.TarInfo(f"{i:06d}.json")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    energon_prepare(root)
    return root


def measure_lengths(processor: str, jsonl: str) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, patches) of each conversation, as the processor makes it (msd's worker code)."""
    from worker.processor import ProcessorChat

    chat = ProcessorChat(processor)
    base = os.path.dirname(jsonl)
    tokens, patches = [], []
    with open(jsonl, "rb") as f:
        for line in f:
            sample = chat.render(orjson.loads(line), base)
            tokens.append(len(sample.tokens))
            patches.append(sample.patches)
    return np.array(tokens), np.array(patches)


# ---------------------------------------------------------------- throughput and memory


def pss_kb(pid: int) -> int:
    from e2e_ranks import pss_kb as pss

    return pss(pid)


def msd_throughput(root: str, processor: str, jsonl: str, samples: int, pad_id: int,
                   image_pass: str = "delivery", ahead_bytes: int | None = None,
                   source: dict | None = None) -> dict:
    """One msd round; `source`: more of the source's keys (a video source's video_fps)."""
    import torch  # noqa: F401 - as a trainer has it, before its loader exists

    # the client of the tree measured (MSD_BENCH_TREE), imported before bench_e2e puts this tree first
    from trainer_client import DataClient
    from trainer_client.rank_core import RankCore

    from bench_e2e import MsdCommands
    from e2e_ranks import AnonShmemSampler, anon_shmem_kb, descendants, pixel_arrays, touch_pages

    run = tempfile.mkdtemp(prefix="msd-round-", dir=root)  # a fresh job directory: no state from a round before
    job = os.path.join(run, "job.yaml")
    with open(job, "w") as f:
        json.dump({"seed": 3, "sources": {"vqa": {"format": "jsonl", "paths": [jsonl], "processor": processor,
                                                  "image_pass": image_pass, **(source or {})}},
                   "batch": {"seq_len": SEQ_LEN, "micro_batch_size": 1, "global_batch_size": 4, "pad_id": pad_id},
                   "topology": {"dp": 1}, "mixture": {"weights": {"vqa": 1.0}},
                   "balance": {"cost": {"quadratic": 1.0, "linear": LM_LINEAR, "patch_linear": ENCODER_LINEAR}},
                   **({"runtime": {"ahead_bytes": ahead_bytes}} if ahead_bytes else {})}, f)
    wire = {"bytes": 0}
    on_pieces = RankCore.on_pieces

    def counted(self: RankCore, frames: list) -> list:  # the data messages' bytes, the same in any tree
        wire["bytes"] += sum(len(f) for f in frames)
        return on_pieces(self, frames)

    RankCore.on_pieces = counted
    before, before_anon = pss_kb(os.getpid()), anon_shmem_kb(os.getpid())
    started = time.perf_counter()
    cluster = MsdCommands(job, 1, in_coordinator=True)
    client = DataClient(cluster.address, rank=0, as_torch=False)
    try:
        next(client)  # the worker started, the first step planned
        first_batch_s = time.perf_counter() - started
        got = tokens = rows = images = 0
        inside_next = 0.0
        t0 = time.perf_counter()
        wire_at_start = wire["bytes"]
        with AnonShmemSampler(os.getpid()) as sampled:
            while got < samples:
                t = time.perf_counter()
                batch = next(client)
                inside_next += time.perf_counter() - t
                got += len(batch["doc_keys"])
                tokens += int(batch["num_tokens"])
                rows += batch["tokens"].shape[0]
                images += int(np.asarray(batch.get("images_per_sample", 0)).sum())
                touch_pages(pixel_arrays(batch))
        seconds = time.perf_counter() - t0
        wire_bytes = wire["bytes"] - wire_at_start  # (messages of steps ahead count, as they crossed)
        loader_pids = [cluster.coordinator.pid, *descendants(cluster.coordinator.pid)]
        loader_kb = sum(pss_kb(p) for p in loader_pids)
        trainer_kb = pss_kb(os.getpid()) - before
        trainer_anon_shmem_kb = anon_shmem_kb(os.getpid()) - before_anon
        held_kb = sum(np.asarray(a).nbytes for a in pixel_arrays(batch)) // 1024  # the micro-batch the trainer has
        workers = len(cluster.worker_pids())
    finally:
        client.close()
        cluster.close()
        RankCore.on_pieces = on_pieces
    return {"samples": got, "seconds": seconds, "samples_per_s": got / seconds, "images": images,
            "wire_bytes_per_image": wire_bytes / max(images, 1), "wire_bytes_per_sample": wire_bytes / got,
            "next_ms": 1000 * inside_next / got,
            "samples_per_s_per_worker": got / seconds,
            "worker_processes": workers, "first_batch_s": first_batch_s, "padding": 1 - tokens / (rows * SEQ_LEN),
            "memory_kb": {"loader_processes": loader_kb, "trainer_growth": trainer_kb, "total": loader_kb + trainer_kb,
                          "trainer_anon_shmem_growth": trainer_anon_shmem_kb, "held_pixel_values": held_kb,
                          "trainer_anon_shmem_over_run": sampled.growth_kb(before_anon)}}


def energon(*args: str) -> dict:
    out = subprocess.run([ENERGON_PYTHON, ENERGON_SCRIPT, *args], capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"{ENERGON_SCRIPT} {' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def energon_throughput(dataset: str, processor: str, samples: int) -> dict:
    out = energon("throughput", dataset, processor, "--seq-len", str(SEQ_LEN), "--samples", str(samples),
                  "--workers", "1")
    out["memory_kb"]["loader_processes"] = out["memory_kb"].pop("workers")
    return out


# ---------------------------------------------------------------- balance


def msd_balance(tokens: np.ndarray, patches: np.ndarray, ranks: int, steps: int) -> dict:
    from coordinator.plan import LENGTH, Planner, SOURCE, POSITION
    from msd_common.spec import BatchConfig, CostConfig, JobConfig, SourceConfig, Stage
    from msd_common.topology import Topology

    source = SourceConfig("vqa", 0, "jsonl", (), packing="whole", long_docs="drop", processor="qwen-vl")
    job = JobConfig(seed=3, sources=(source,), batch=BatchConfig(SEQ_LEN, 1, ranks * MICRO_BATCHES), dp=ranks,
                    topology=Topology(ranks), stages=(Stage((1.0,)),),
                    cost=CostConfig(1.0, LM_LINEAR, 0.0, ENCODER_LINEAR))
    planner = Planner(job, [len(tokens)])
    horizon = int(4 * (steps + 2) * job.step_tokens / max(float(tokens.mean()), 1.0)) + 10_000
    records = planner.streams[0].records_array(0, horizon)  # stream position -> record (epochs after epochs)
    lengths = np.where(tokens <= SEQ_LEN, tokens, 0)  # longer ones are dropped (long_docs: drop)

    class Known:
        def window(self, s: int, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
            r = records[start:start + count]
            if len(r) < count:
                raise RuntimeError("bench horizon too short")
            return r, lengths[r]

        def patches(self, s: int, positions: np.ndarray) -> np.ndarray:
            return patches[records[positions]]

        def patch_squares(self, s: int, positions: np.ndarray) -> np.ndarray:  # (the cost here has no such term)
            return patches[records[positions]] ** 2

    known = Known()
    ratios, used = [], 0
    for _ in range(steps):
        plan = planner.plan_step(known)
        p = plan.pieces
        cost = piece_cost(p[:, LENGTH], patches[records[p[:, POSITION]]])
        per_rank = np.bincount(plan.rank, weights=cost, minlength=ranks)
        ratios.append(float(per_rank.max() / per_rank.mean()))
        used += int(p[:, LENGTH].sum())
        assert (p[:, SOURCE] == 0).all()
    return {"max_over_mean": float(np.mean(ratios)), "per_step": ratios,
            "padding": 1 - used / (steps * ranks * MICRO_BATCHES * SEQ_LEN)}


def energon_balance(dataset: str, table: str, ranks: int, steps: int) -> dict:
    out = energon("balance", dataset, table, "--seq-len", str(SEQ_LEN), "--ranks", str(ranks), "--steps",
                  str(steps), "--micro-batches", str(MICRO_BATCHES))
    ratios, used = [], 0
    for s in range(steps):
        per_rank = []
        for rank in out["ranks"]:
            lengths = [n for seq in rank[s] for n in seq[0]]
            patches = [p for seq in rank[s] for p in seq[1]]
            per_rank.append(float(piece_cost(np.array(lengths), np.array(patches)).sum()))
            used += sum(lengths)
        per_rank_a = np.array(per_rank)
        ratios.append(float(per_rank_a.max() / per_rank_a.mean()))
    return {"max_over_mean": float(np.mean(ratios)), "per_step": ratios,
            "padding": 1 - used / (steps * ranks * MICRO_BATCHES * SEQ_LEN)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write the result here")
    ap.add_argument("--records", type=int, default=600)
    ap.add_argument("--samples", type=int, default=400,
                    help="samples timed per throughput round (fewer than --records: no record twice)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16, help="steps of the balance measurement")
    ap.add_argument("--balance-records", type=int, default=12_000)
    ap.add_argument("--keep", action="store_true", help="keep the data directory")
    ap.add_argument("--designs", default="msd,msd-prepare,energon",
                    help="loaders alternated in the throughput rounds (msd-prepare: image_pass: prepare)")
    ap.add_argument("--baseline-tree", help="a checkout of an earlier msd: adds design msd-before, its default "
                    "path; then every msd round runs in a process of its own, this tree's and that one's alike")
    ap.add_argument("--one-round", nargs=5, metavar=("IMAGE_PASS", "ROOT", "PROCESSOR", "JSONL", "PAD_ID"),
                    help=argparse.SUPPRESS)  # one msd round in this process, its result on stdout
    args = ap.parse_args()
    if args.one_round:
        image_pass, root, processor, jsonl, pad_id = args.one_round
        print(json.dumps(msd_throughput(root, processor, jsonl, args.samples, int(pad_id), image_pass)))
        return
    if not os.path.exists(ENERGON_PYTHON):
        sys.exit(f"no Energon environment at {ENERGON_PYTHON}: run `make bench-vlm-env` (or set MSD_ENERGON_PYTHON)")
    root = tempfile.mkdtemp(prefix="msd-bench-vlm-")
    try:
        t0 = time.perf_counter()
        processor, jsonl, dataset = write_data(root, args.records)
        tokens, patches = measure_lengths(processor, jsonl)
        from tokenizers import Tokenizer

        pad_id = Tokenizer.from_file(os.path.join(processor, "tokenizer.json")).token_to_id("<|endoftext|>")
        result: dict = {"records": args.records, "seq_len": SEQ_LEN,
                        "tokens_per_sample": {"mean": float(tokens.mean()), "max": int(tokens.max())},
                        "patches_per_sample": {"mean": float(patches.mean()), "max": int(patches.max())},
                        "data_s": time.perf_counter() - t0}
        # msd-prepare: the same job with `image_pass: prepare` (the processor run whole at prepare time)
        designs = args.designs.split(",") + (["msd-before"] if args.baseline_tree else [])
        rounds: dict[str, list[dict]] = {d: [] for d in designs}

        def msd_round(design: str) -> dict:
            image_pass = "prepare" if design == "msd-prepare" else "delivery"
            if not args.baseline_tree:
                return msd_throughput(root, processor, jsonl, args.samples, pad_id, image_pass)
            tree = args.baseline_tree if design == "msd-before" else ROOT
            env = {**os.environ, "MSD_BENCH_TREE": tree, "PYTHONPATH": tree}
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--samples", str(args.samples),
                                  "--one-round", image_pass, root, processor, jsonl, str(pad_id)],
                                 env=env, capture_output=True, text=True, timeout=1800)
            if out.returncode != 0:
                raise RuntimeError(f"{design} round failed: {out.stderr[-2000:]}")
            return json.loads(out.stdout.strip().splitlines()[-1])

        for r in range(args.rounds):
            order = list(rounds) if r % 2 == 0 else list(rounds)[::-1]
            for design in order:
                if design == "energon":
                    rounds[design].append(energon_throughput(dataset, processor, args.samples))
                else:
                    rounds[design].append(msd_round(design))
                print(f"# round {r} {design}: {rounds[design][-1]['samples_per_s_per_worker']:.1f} samples/s",
                      file=sys.stderr)
        from e2e_ranks import over_run_mb

        for design, runs in rounds.items():
            result[design] = {
                "samples_per_s_per_worker": spread([x["samples_per_s_per_worker"] for x in runs]),
                "memory_mb": spread([x["memory_kb"]["total"] / 1024 for x in runs]),
                "loader_processes_mb": spread([x["memory_kb"]["loader_processes"] / 1024 for x in runs]),
                "trainer_growth_mb": spread([x["memory_kb"]["trainer_growth"] / 1024 for x in runs]),
                "trainer_anon_shmem_growth_mb": spread([x["memory_kb"].get("trainer_anon_shmem_growth", 0) / 1024
                                                        for x in runs]),
                "held_pixel_values_mb": spread([x["memory_kb"].get("held_pixel_values", 0) / 1024 for x in runs]),
                # sampled every 20 ms over the timed part of a round: its mean and its peak (above the
                # baseline, and above where the timed part began); the kernel's exact high-water mark
                **{f"trainer_anon_shmem_{k}_mb": spread(values) for k, values in over_run_mb(runs).items()},
                "padding": spread([x["padding"] for x in runs]),
                "worker_processes": runs[0]["worker_processes"],
            }
            if "first_batch_s" in runs[0]:
                result[design]["first_batch_s"] = spread([x["first_batch_s"] for x in runs])
            if "wire_bytes_per_image" in runs[0]:
                result[design]["wire_bytes_per_image"] = spread([x["wire_bytes_per_image"] for x in runs])
                result[design]["next_ms_per_sample"] = spread([x["next_ms"] for x in runs])
        if "energon" in result:
            result["throughput_ratio"] = (result["msd"]["samples_per_s_per_worker"]["median"]
                                          / result["energon"]["samples_per_s_per_worker"]["median"])
        if "msd-before" in result:  # issue 59's targets: frames as bytes against the float pixel values before
            now, then = result["msd"], result["msd-before"]
            result["frames_vs_before"] = {
                "wire_bytes_per_image": now["wire_bytes_per_image"]["median"]
                / then["wire_bytes_per_image"]["median"],
                "samples_per_s": now["samples_per_s_per_worker"]["median"]
                / then["samples_per_s_per_worker"]["median"],
                "trainer_growth_mb": [now["trainer_growth_mb"]["median"], then["trainer_growth_mb"]["median"]],
                "next_ms_per_sample": [now["next_ms_per_sample"]["median"], then["next_ms_per_sample"]["median"]]}
            if "energon" in result:
                energon_growth = result["energon"]["trainer_growth_mb"]["median"]
                result["frames_vs_before"]["energon_trainer_growth_mb"] = energon_growth
        # balance: the measured lengths, resampled to more records
        pick = np.random.default_rng(1).integers(0, len(tokens), args.balance_records)
        table = os.path.join(root, "lengths.npz")
        np.savez(table, tokens=tokens[pick], patches=patches[pick])
        keys = write_keys_dataset(os.path.join(root, "keys"), args.balance_records)
        result["balance"] = {}
        for ranks in (8, 64):
            result["balance"][str(ranks)] = {
                "msd": msd_balance(tokens[pick], patches[pick], ranks, args.steps),
                "energon": energon_balance(keys, table, ranks, args.steps)}
            print(f"# balance at {ranks} ranks: msd {result['balance'][str(ranks)]['msd']['max_over_mean']:.4f}, "
                  f"energon {result['balance'][str(ranks)]['energon']['max_over_mean']:.4f}", file=sys.stderr)
        result["targets"] = {
            "throughput_at_least_energon": result.get("throughput_ratio", 0.0) >= 1.0,
            "padding_at_most_1pct": result["balance"]["8"]["msd"]["padding"] <= 0.01
            and result["msd"]["padding"]["median"] <= 0.01,
            "max_over_mean_8_ranks_at_most_1.05": result["balance"]["8"]["msd"]["max_over_mean"] <= 1.05,
        }
        emit(result, args.json)
    finally:
        if args.keep:
            print(f"# data kept in {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
