"""The reference environment for vision-language checks: transformers with torch and torchvision
(.venv-vlm, made by `make .venv-vlm`, which `make test` depends on), where AutoProcessor builds the
Qwen-VL processors whole, as their users load them. The project's own environment has no
torchvision: its workers build the processor without a video processor (worker/processor.py)."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE_PYTHON = os.environ.get("MSD_VLM_PYTHON", os.path.join(ROOT, ".venv-vlm", "bin", "python"))


def reference(processor_dir: str, conversations: str, out: str, backend: str = "pil") -> dict[int, dict]:
    """tests/vlm/reference.py's answer, by record: {name: array}."""
    if not os.path.exists(REFERENCE_PYTHON):
        pytest.fail(f"no reference environment at {REFERENCE_PYTHON}: run `make .venv-vlm` (or set MSD_VLM_PYTHON)")
    subprocess.run([REFERENCE_PYTHON, os.path.join(ROOT, "tests", "vlm", "reference.py"), processor_dir,
                    conversations, out, backend], check=True, timeout=600)
    by_record: dict[int, dict] = {}
    with np.load(out) as z:
        for key in z.files:
            i, name = key.split("/")
            by_record.setdefault(int(i), {})[name] = z[key]
    return by_record


def torchcodec_env(folder: str) -> dict[str, str]:
    """The environment in which the reference environment's torchcodec (transformers' default video
    loader) loads: it needs FFmpeg's shared libraries, which this machine has only inside the PyAV
    wheel (renamed there); links under their usual names in `folder` make them reachable."""
    import glob

    libs = subprocess.run([REFERENCE_PYTHON, "-c", "import av, os; print(os.path.join(os.path.dirname("
                           "os.path.dirname(av.__file__)), 'av.libs'))"], check=True, capture_output=True,
                          text=True, timeout=120).stdout.strip()
    os.makedirs(folder, exist_ok=True)
    for name in ("avutil", "avcodec", "avformat", "avdevice", "avfilter", "swscale", "swresample"):
        for path in glob.glob(os.path.join(libs, f"lib{name}-*.so.*")):
            major = os.path.basename(path).split(".so.")[1].split(".")[0]
            link = os.path.join(folder, f"lib{name}.so.{major}")
            if not os.path.exists(link):
                os.symlink(path, link)
    return {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join([folder, libs, os.environ.get("LD_LIBRARY_PATH", "")])}


def write_notes(root: str, n: int) -> str:
    """A text source beside the images: n JSONL notes of growing length in ROOT/text/notes.jsonl."""
    import orjson

    os.makedirs(os.path.join(root, "text"), exist_ok=True)
    with open(os.path.join(root, "text", "notes.jsonl"), "wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"text": f"note {i}: " + "plain text " * (5 + i)}) + b"\n")
    return "text/notes.jsonl"


def token_id(processor_dir: str, token: str) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(processor_dir, "tokenizer.json")).token_to_id(token)


def pieces_of(batch: dict):
    """Every piece of a micro-batch, in packing order: (row, start, doc_key, length, piece index,
    index of its first entry in the image arrays, by images_per_sample)."""
    keys, lengths = batch["doc_keys"].tolist(), batch["piece_lengths"].tolist()
    k = image = 0
    for row, count in enumerate(batch["pieces_per_row"].tolist()):
        start = 0
        for _ in range(count):
            yield row, start, keys[k], lengths[k], k, image
            image += int(batch["images_per_sample"][k])
            start += lengths[k]
            k += 1


def run_image_job(root: Any, processor: str, *, seed: int, pad_token: str, steps: int, seq_len: int = 2048,
                  micro_batch_size: int = 1, source: dict | None = None,
                  devices: dict[int, str] | None = None) -> tuple[dict, dict[int, dict], str]:
    """A job of ROOT/data's image conversations on `processor` (a directory in ROOT; `source`: more of
    its keys) mixed with ROOT/text's notes, DP 2, four rows a step, through real workers and ranks;
    returns what each rank received, transformers' reference by record, and the
    job's log."""
    from tests.conftest import write_job
    from tests.integration.harness import run_job

    job = {
        "seed": seed,
        "sources": {
            "vqa": {"format": "jsonl", "paths": ["data/conversations.jsonl"],
                    "processor": os.path.basename(processor), **(source or {})},
            "notes": {"format": "jsonl", "paths": ["text/notes.jsonl"], "packing": "whole"},
        },
        "batch": {"seq_len": seq_len, "micro_batch_size": micro_batch_size, "global_batch_size": 4,
                  "pad_id": token_id(processor, pad_token)},
        "topology": {"dp": 2},
        "mixture": {"weights": {"vqa": 0.8, "notes": 0.2}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 4, "lookahead_steps": 1},
    }
    log = os.path.join(str(root), "job.log")
    received = run_job(write_job(str(root), job), workers=2, ranks=2, steps=steps, log_path=log, timeout_s=300,
                       devices=devices)
    ref = reference(processor, os.path.join(str(root), "data", "conversations.jsonl"),
                    os.path.join(str(root), "ref.npz"))
    with open(log) as f:
        return received, ref, f.read()


def check_text(batch: dict, row: int, span: slice, expected: dict) -> None:
    """A piece's tokens are the processor's, and its loss mask its assistant mask (position i
    predicts token i + 1), with something to train on."""
    np.testing.assert_array_equal(batch["tokens"][row, span], expected["input_ids"])
    mask = batch["loss_mask"][row, span]
    np.testing.assert_array_equal(mask[:-1], expected["assistant_masks"][1:])
    assert mask.sum() > 0


def check_anyres(received: dict, ref: dict[int, dict], log: str) -> tuple[int, int]:
    """The LLaVA models' micro-batches against the processor: every image piece's tokens and mask, its
    patches (padded with zeros to the micro-batch's most), `image_sizes`, and LLaVA-OneVision's
    `batch_num_images`. Returns (image pieces checked, pieces whose patches the micro-batch padded)."""
    from trainer_client.batch import BATCH_KEYS
    from msd_common.doc_keys import split_doc_key

    schema = {k.key for k in BATCH_KEYS}
    checked = padded = 0
    for batches in received.values():
        for b in batches:
            assert set(b) - {"received_at"} <= schema, set(b) - schema
            images_seen = with_images = 0
            for row, start, key, n, k, image in pieces_of(b):
                source, record = split_doc_key(key)
                images = int(b["images_per_sample"][k])
                images_seen += images
                if source == 1:
                    assert images == 0
                    continue
                expected = ref[record]
                check_text(b, row, slice(start, start + n), expected)
                want = expected["pixel_values"]  # [images, patches, 3, S, S]
                assert images == len(want) > 0
                got = np.asarray(b["pixel_values"])[image:image + images]
                np.testing.assert_array_equal(got[:, :want.shape[1]], want)
                assert not got[:, want.shape[1]:].any()  # the micro-batch's padding: zeros
                padded += got.shape[1] > want.shape[1]
                np.testing.assert_array_equal(b["image_sizes"][image:image + images], expected["image_sizes"])
                if "batch_num_images" in expected:
                    assert b["batch_num_images"][with_images] == expected["batch_num_images"][0] == images
                with_images += 1
                checked += 1
            if images_seen:
                assert len(b["pixel_values"]) == images_seen
            assert ("batch_num_images" in b) == bool(with_images and "batch_num_images" in expected)
            if "batch_num_images" in b:
                assert len(b["batch_num_images"]) == with_images
    assert "exited with" not in log
    return checked, padded
