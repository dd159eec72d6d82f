"""Run in the reference environment (.venv-vlm, with the project's dependencies; FFmpeg's libraries
reachable for torchcodec, see test_video.py): `python video_job.py QWEN2_5_VL_DIR WORK_DIR`.

A real job (coordinator, a host of 2 worker processes, 2 trainer processes on loopback, rank 1
making its pixel values on a torch device) over conversations with videos, a corrupt one and one
over max_video_s among them. Every piece every rank received is checked against the processor's
own apply_chat_template of its record (videos decoded by torchcodec) and the model's
get_rope_index: tokens, loss mask, video_grid_thw, second_per_grid_ts, pixel_values_videos and
position ids. Prints one JSON line."""

from __future__ import annotations

import functools
import json
import os
import sys
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from msd_common.doc_keys import split_doc_key  # noqa: E402
from tests.integration.harness import run_job  # noqa: E402
from tests.vlm.video_check import write_video  # noqa: E402

CLIPS = 14
BAD = {5: "corrupt", 9: "too_long"}  # records whose video must skip them


def write_data(work: str) -> list[dict]:
    """CLIPS conversations, each with one or two short videos of assorted sizes, rates and codecs."""
    rng = np.random.default_rng(4)
    os.makedirs(os.path.join(work, "clips"), exist_ok=True)
    records = []
    for i in range(CLIPS):
        parts = []
        for j in range(1 + int(rng.integers(0, 2))):
            name = f"clips/{i:03d}-{j}.mp4"
            # the long one: 13 s or more; the others 6 s at most
            frames = 400 if BAD.get(i) == "too_long" else int(rng.integers(12, 60))
            write_video(os.path.join(work, name), frames, int(rng.choice([10, 24, 30])),
                        16 * int(rng.integers(4, 14)), 16 * int(rng.integers(4, 12)),
                        str(rng.choice(["libx264", "mpeg4"])))
            parts.append({"type": "video", "video": name})
        if BAD.get(i) == "corrupt":
            with open(os.path.join(work, parts[0]["video"]), "wb") as f:
                f.write(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
        parts.append({"type": "text", "text": f"clip {i}: what happens"})
        records.append({"messages": [{"role": "user", "content": parts},
                                     {"role": "assistant", "content": [{"type": "text",
                                                                        "text": "things move " * (1 + i % 4)}]}]})
    with open(os.path.join(work, "clips.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return records


def main(processor_dir: str, work: str) -> None:
    from transformers import AutoProcessor
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel as Model

    records = write_data(work)
    pad = AutoProcessor.from_pretrained(processor_dir).tokenizer.convert_tokens_to_ids("<|endoftext|>")
    job = {"seed": 5,
           "sources": {"clips": {"format": "jsonl", "paths": ["clips.jsonl"], "processor": processor_dir,
                                 "video_fps": 2, "max_video_s": 7}},
           "batch": {"seq_len": 4096, "micro_batch_size": 1, "global_batch_size": 2, "pad_id": pad},
           "topology": {"dp": 2}, "mixture": {"weights": {"clips": 1.0}},
           "runtime": {"heartbeat_s": 0.5, "prepare_batch": 4, "lookahead_steps": 2}}
    path = os.path.join(work, "job.yaml")
    with open(path, "w") as f:
        json.dump(job, f)
    steps = 5
    received = run_job(path, workers=2, ranks=2, steps=steps, log_path=os.path.join(work, "job.log"), timeout_s=300,
                       devices={1: "cpu"})

    processor = AutoProcessor.from_pretrained(processor_dir)
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2,
                                                                                 tokens_per_second=4.0)))
    model.get_vision_position_ids = functools.partial(Model.get_vision_position_ids, model)

    @functools.lru_cache(maxsize=None)
    def reference(record: int) -> dict:
        messages = [{**m, "content": [{**p, "video": os.path.join(work, p["video"])} if p["type"] == "video" else p
                                      for p in m["content"]]} for m in records[record]["messages"]]
        out = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, return_tensors="np", fps=2)
        ids = np.asarray(out["input_ids"])
        positions, _ = Model.get_rope_index(model, torch.from_numpy(ids), torch.from_numpy(
            np.asarray(out["mm_token_type_ids"])), video_grid_thw=torch.from_numpy(np.asarray(out["video_grid_thw"])),
            second_per_grid_ts=torch.tensor(np.asarray(out["second_per_grid_ts"]), dtype=torch.float32))
        return {**{k: np.asarray(v) for k, v in out.items()}, "position_ids": positions[:, 0].numpy()}

    problems, pieces, videos, seen = [], 0, 0, set()
    for rank, batches in received.items():
        for b in batches:
            keys, lengths = b["doc_keys"].tolist(), b["piece_lengths"].tolist()
            k = video_row = video = 0
            for row, count in enumerate(b["pieces_per_row"].tolist()):
                start = 0
                for _ in range(count):
                    _, record = split_doc_key(keys[k])
                    record, n = int(record), lengths[k]
                    seen.add(record)
                    ref = reference(record)
                    mine = int(b["videos_per_sample"][k])
                    grids = b["video_grid_thw"][video:video + mine]
                    rows = int(grids.prod(axis=1).sum())
                    checks = {
                        "tokens": np.array_equal(b["tokens"][row, start:start + n], ref["input_ids"][0]),
                        "mask": np.array_equal(b["loss_mask"][row, start:start + n - 1],
                                               ref["assistant_masks"][0][1:]),
                        "grid": np.array_equal(grids, ref["video_grid_thw"]),
                        "seconds": np.array_equal(b["second_per_grid_ts"][video:video + mine].astype(np.float64),
                                                  ref["second_per_grid_ts"].astype(np.float64)),
                        "pixels": np.array_equal(b["pixel_values_videos"][video_row:video_row + rows],
                                                 ref["pixel_values_videos"]),
                        "positions": np.array_equal(b["position_ids"][:, row, start:start + n], ref["position_ids"]),
                    }
                    bad = [name for name, ok in checks.items() if not ok]
                    if bad:
                        problems.append({"rank": rank, "step": b["step"], "record": record, "bad": bad})
                    pieces += 1
                    videos += mine
                    video, video_row, start, k = video + mine, video_row + rows, start + n, k + 1
    skipped = set()  # (kind, line number) of the coordinator's skip notes
    with open(os.path.join(work, "job.log")) as f:
        for line in f:
            if "record skipped (" in line:
                kind = line.split("record skipped (")[1].split(")")[0]
                skipped.add((kind, int(line.split("clips.jsonl:")[1].split(":")[0])))
    print(json.dumps({"skipped": sorted(skipped), "pieces": pieces, "videos": videos, "problems": problems[:5],
                      "records_seen": sorted(seen), "bad_records_seen": sorted(seen & set(BAD)),
                      "steps": {r: len(b) for r, b in received.items()}}))

if __name__ == "__main__":
    main(*sys.argv[1:3])
