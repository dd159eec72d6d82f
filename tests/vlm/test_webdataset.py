"""The same image conversations as WebDataset shards (the layout Megatron-Energon's crude datasets
read: a `.json` conversation and its image entries per sample, the image parts naming them)
through a real job: every sample a rank gets is the one the JSONL form of its conversation gives."""

from __future__ import annotations

import io
import os
import tarfile

import numpy as np
import orjson
import pytest

from msd.testing.vlm_data import write_image_conversations, write_qwen2_5_vl_processor
from msd_common.doc_keys import split_doc_key
from msd_common.frames import finished
from tests.conftest import write_job
from tests.integration.harness import run_job
from tests.vlm.conftest import pieces_of, token_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RECORDS = 16


def write_shards(folder: str, records: list[dict], shards: int = 2) -> None:
    """records (image parts naming files under `folder`) as WebDataset shards in `folder`/wds."""
    os.makedirs(os.path.join(folder, "wds"))
    tars = [tarfile.open(os.path.join(folder, "wds", f"shard-{k}.tar"), "w") for k in range(shards)]
    for i, record in enumerate(records):
        files: dict[str, bytes] = {}
        messages = []
        for m in record["messages"]:
            parts = []
            for p in m["content"]:
                if p["type"] == "image":
                    name = f"{len(files)}.png"
                    with open(os.path.join(folder, p["image"]), "rb") as f:
                        files[name] = f.read()
                    p = {"type": "image", "image": name}
                parts.append(p)
            messages.append({**m, "content": parts})
        for suffix, data in [("json", orjson.dumps({"messages": messages})), *files.items()]:
            info = tarfile.TarInfo(f"{i:05d}.{suffix}")
            info.size = len(data)
            tars[i * shards // len(records)].addfile(info, io.BytesIO(data))
    for tar in tars:
        tar.close()


def test_webdataset_conversations_through_a_job(tmp_path):
    from worker.processor import ProcessorChat

    processor = write_qwen2_5_vl_processor(str(tmp_path / "qwen"), max_pixels=60_000)
    records = write_image_conversations(str(tmp_path / "data"), RECORDS, seed=5, sizes=(40, 200), max_images=2)
    write_shards(str(tmp_path / "data"), records)
    job = {
        "seed": 2,
        "sources": {"vqa": {"format": "webdataset", "paths": ["data/wds/*.tar"], "processor": "qwen"}},
        "batch": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 2,
                  "pad_id": token_id(processor, "<|endoftext|>")},
        "topology": {"dp": 2},
        "mixture": {"weights": {"vqa": 1.0}},
        "runtime": {"heartbeat_s": 0.5},
    }
    received = run_job(write_job(str(tmp_path), job), workers=2, ranks=2, steps=4, timeout_s=200)
    chat = ProcessorChat(processor)
    checked = set()
    for batches in received.values():
        for b in batches:
            assert b["position_ids"].shape == (3, *b["tokens"].shape)
            patches = 0
            for row, start, key, n, _, _ in pieces_of(b):
                _, record = split_doc_key(key)
                want = chat.render(records[record], str(tmp_path / "data"))
                assert chat.finish(want, "expected") is None  # its image pass
                np.testing.assert_array_equal(b["tokens"][row, start:start + n], want.tokens)
                pixels = finished(want.image_arrays)["pixel_values"]  # its frames, finished as the client does
                np.testing.assert_array_equal(b["pixel_values"][patches:patches + len(pixels)], pixels)
                patches += len(pixels)
                checked.add(record)
    assert len(checked) >= 8
