"""Megatron-Energon's side of tools/bench_vlm.py, run in the environment that has Energon
(.venv-vlm after `make bench-vlm-env`: torch, torchvision, transformers, megatron-energon). Not
imported by msd: bench_vlm.py runs it and reads the JSON it prints.

    python tools/bench_vlm_energon.py throughput DATASET PROCESSOR --seq-len N --samples N --workers W
    python tools/bench_vlm_energon.py balance DATASET LENGTHS.npz --seq-len N --ranks R --steps S --micro-batches M

The loader is what a Megatron user writes with Energon for a vision-language model: a
CrudeWebdataset (a JSON conversation and its images per sample, in WebDataset shards prepared
with `energon prepare`), a TaskEncoder whose cooker decodes the sample, whose encode_sample runs
the model's processor (transformers' AutoProcessor, PIL image backend: the same processor as
msd's workers) and whose packing hooks pack samples into sequences of seq_len inside each worker
process (first-fit decreasing over the packing buffer, the `greedy_knapsack` of Megatron-LM's
examples/multimodal), one packed sequence per micro-batch.

- throughput: samples per second, one rank, W worker processes, after the first sequence;
  padding of the sequences; the proportional set size (PSS) of the worker processes and the
  trainer process's PSS growth since the loader was made (torch already imported).
- balance: for each of R ranks, its loader (WorkerConfig(rank, R)), with encode_sample reading
  each sample's (tokens, patches) from LENGTHS.npz (measured with the real processor by
  bench_vlm.py) instead of running the processor: the packing is Energon's, the lengths the
  processor's. Prints each rank's packed sequences of the first S steps (M sequences a step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e_ranks import AnonShmemSampler, anon_shmem_kb, children, pixel_arrays, pss_kb, touch_pages  # noqa: E402  (stdlib and numpy only: importable here)


def greedy_knapsack(sizes: list[int], capacity: int) -> list[list[int]]:
    """Indexes of the samples of each sequence: longest first, each into the first sequence with
    room (Megatron-LM examples/multimodal's greedy_knapsack); a sample over capacity alone."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, r in enumerate(room):
            if sizes[i] <= r:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


def make_encoder(mode: str, seq_len: int, processor_dir: str | None, lengths: str | None,
                 video_fps: float | None = None) -> Any:
    from megatron.energon import DefaultTaskEncoder, Sample, SkipSample, stateless
    from megatron.energon.flavors.webdataset.sample_decoder import SampleDecoder
    from megatron.energon.task_encoder.cooking import Cooker, basic_sample_keys

    @dataclasses.dataclass
    class Conversation(Sample):
        messages: list
        images: dict

    @dataclasses.dataclass
    class Encoded(Sample):
        tokens: np.ndarray
        mask: np.ndarray
        arrays: dict
        patches: int

    @stateless
    def cook(sample: dict) -> Conversation:
        record = sample["json"]
        images = {k: v for k, v in sample.items() if k.endswith((".jpg", ".png", ".jpeg", ".mp4"))}
        return Conversation(**basic_sample_keys(sample), messages=record.get("messages", []), images=images)

    def video_frames(processor: Any, decoder: Any) -> Any:
        """A video's frames as a Megatron-Energon user samples them: from the AVDecoder its sample decoder
        made of the entry, as many frames spread evenly as the processor samples at `video_fps` (whole
        temporal patches, within its frame limits)."""
        from megatron.energon.av import get_single_frames_uniform

        duration = decoder.get_metadata(get_audio=False).video_duration
        video = processor.video_processor
        t = int(video.temporal_patch_size)
        n = max(t, int(duration * video_fps) // t * t)
        n = min(max(n, int(video.min_frames)), int(video.max_frames)) // t * t
        return get_single_frames_uniform(decoder, n)

    table = np.load(lengths) if lengths else None

    class ProcessorEncoder(DefaultTaskEncoder):
        decoder = SampleDecoder(image_decode="pil")
        cookers = [Cooker(cook)]

        def __init__(self) -> None:
            super().__init__()
            self.processor = None
            if processor_dir is not None:
                from transformers import AutoImageProcessor, AutoProcessor

                self.processor = AutoProcessor.from_pretrained(
                    processor_dir, image_processor=AutoImageProcessor.from_pretrained(processor_dir, backend="pil"))

        @stateless
        def encode_sample(self, sample: Conversation) -> Encoded:
            if table is not None:  # balance: the processor's lengths, measured beforehand
                i = int(sample.__key__)
                n = int(table["tokens"][i])
                if n > seq_len:
                    raise SkipSample()
                return Encoded.derive_from(sample, tokens=np.zeros(n, np.int32), mask=np.zeros(0), arrays={},
                                           patches=int(table["patches"][i]))
            def part(p: dict) -> dict:
                if p.get("type") == "image":
                    return {"type": "image", "image": sample.images[p["image"]]}
                if p.get("type") == "video":
                    return {"type": "video", "video": video_frames(self.processor, sample.images[p["video"]])}
                return p

            messages = [{**m, "content": [part(p) for p in m["content"]]} if isinstance(m["content"], list) else m
                        for m in sample.messages]
            videos = {"processor_kwargs": {"do_sample_frames": False, "fps": video_fps}} if video_fps else {}
            out = self.processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                     return_assistant_tokens_mask=True, return_tensors="np", **videos)
            tokens = np.asarray(out["input_ids"])[0].astype(np.int32)
            if len(tokens) > seq_len:
                raise SkipSample()
            arrays = {k: np.asarray(out[k]) for k in ("pixel_values", "image_grid_thw", "pixel_values_videos",
                                                      "video_grid_thw") if k in out}
            patches = sum(len(arrays[k]) for k in ("pixel_values", "pixel_values_videos") if k in arrays)
            return Encoded.derive_from(sample, tokens=tokens,
                                       mask=np.asarray(out["assistant_masks"])[0].astype(np.uint8),
                                       arrays=arrays, patches=patches)

        def select_samples_to_pack(self, samples: list) -> list[list]:
            bins = greedy_knapsack([len(s.tokens) for s in samples], seq_len)
            return [[samples[i] for i in b] for b in bins]

        @stateless
        def pack_selected_samples(self, samples: list) -> dict:
            tokens = np.concatenate([s.tokens for s in samples])
            packed = {"tokens": tokens, "lengths": np.array([len(s.tokens) for s in samples]),
                      "patches": np.array([s.patches for s in samples])}
            if mode == "throughput":
                packed["loss_mask"] = np.concatenate([s.mask for s in samples])
                for name in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"):
                    parts = [s.arrays[name] for s in samples if name in s.arrays]
                    if parts:
                        packed[name] = np.concatenate(parts)
            return packed

        def batch(self, samples: list) -> list:
            return samples

    return ProcessorEncoder()


def loader(dataset: str, encoder: Any, rank: int, world: int, workers: int, buffer: int) -> Any:
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    config = WorkerConfig(rank=rank, world_size=world, num_workers=workers)
    ds = get_train_dataset(dataset, worker_config=config, batch_size=1, shuffle_buffer_size=100,
                           max_samples_per_sequence=100, packing_buffer_size=buffer, task_encoder=encoder)
    return get_loader(ds)


def throughput(args: argparse.Namespace) -> dict:
    import torch  # noqa: F401 - the trainer has torch imported before its loader exists

    before, before_anon = pss_kb(os.getpid()), anon_shmem_kb(os.getpid())
    encoder = make_encoder("throughput", args.seq_len, args.processor, None, args.video_fps)
    it = iter(loader(args.dataset, encoder, 0, 1, args.workers, args.buffer))
    next(it)  # workers started, first buffer packed (not kept: the trainer holds one batch, as msd's)
    samples = tokens = sequences = 0
    t0 = time.perf_counter()
    with AnonShmemSampler(os.getpid()) as sampled:
        while samples < args.samples:
            (packed,) = next(it)
            samples += len(packed["lengths"])
            tokens += int(packed["lengths"].sum())
            sequences += 1
            touch_pages(pixel_arrays(packed))
    seconds = time.perf_counter() - t0
    workers = children(os.getpid())
    worker_kb = sum(pss_kb(p) for p in workers)
    trainer_kb = pss_kb(os.getpid()) - before
    trainer_anon_shmem_kb = anon_shmem_kb(os.getpid()) - before_anon
    held_kb = sum(np.asarray(a).nbytes for a in pixel_arrays(packed)) // 1024  # the batch the trainer has
    return {"samples": samples, "seconds": seconds, "samples_per_s": samples / seconds,
            "samples_per_s_per_worker": samples / seconds / args.workers, "sequences": sequences,
            "padding": 1 - tokens / (sequences * args.seq_len), "worker_processes": len(workers),
            "memory_kb": {"workers": worker_kb, "trainer_growth": trainer_kb, "total": worker_kb + trainer_kb,
                          "trainer_anon_shmem_growth": trainer_anon_shmem_kb, "held_pixel_values": held_kb,
                          "trainer_anon_shmem_over_run": sampled.growth_kb(before_anon)}}


def balance(args: argparse.Namespace) -> dict:
    encoder = make_encoder("balance", args.seq_len, None, args.lengths)
    ranks = []
    for rank in range(args.ranks):
        it = iter(loader(args.dataset, encoder, rank, args.ranks, 0, args.buffer))
        steps = []
        for _ in range(args.steps):
            step = []
            for _ in range(args.micro_batches):
                (packed,) = next(it)
                step.append([packed["lengths"].tolist(), packed["patches"].tolist()])
            steps.append(step)
        ranks.append(steps)
    return {"ranks": ranks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["throughput", "balance"])
    ap.add_argument("dataset")
    ap.add_argument("data", help="the processor directory (throughput) or LENGTHS.npz (balance)")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--buffer", type=int, default=64, help="packing_buffer_size")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--video-fps", type=float, default=None, help="video parts: frames sampled a second")
    args = ap.parse_args()
    if args.mode == "throughput":
        args.processor = args.data
        result = throughput(args)
    else:
        args.lengths = args.data
        result = balance(args)
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    sys.stdout.flush()
    os._exit(0)  # the loader's worker processes go with us


if __name__ == "__main__":
    main()
