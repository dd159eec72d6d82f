"""msd.testing.vlm_data: the Qwen2.5-VL processor directory made here loads with transformers'
own classes (tokenizer, and the image processor's PIL backend, which needs no torchvision), and
the image conversations point at real images."""

from __future__ import annotations

import os

import numpy as np
import orjson
import pytest

from msd.testing.vlm_data import QWEN_VL_SPECIAL, write_image_conversations, write_qwen2_5_vl_processor

transformers = pytest.importorskip("transformers")


def test_the_processor_directory_loads_with_transformers_classes(tmp_path):
    from PIL import Image
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    proc = write_qwen2_5_vl_processor(str(tmp_path / "proc"), max_pixels=128 * 28 * 28)
    tokenizer = AutoTokenizer.from_pretrained(proc)
    for token in QWEN_VL_SPECIAL:  # one id each: the processor counts <|image_pad|> ids
        assert len(tokenizer(token, add_special_tokens=False).input_ids) == 1, token
    records = write_image_conversations(str(tmp_path / "data"), 6, seed=3, max_images=2)
    lines = open(tmp_path / "data" / "conversations.jsonl", "rb").read().splitlines()
    assert [orjson.loads(line) for line in lines] == records
    paths = [part["image"] for r in records for m in r["messages"] if m["role"] == "user"
             for part in m["content"] if part["type"] == "image"]
    assert paths and all(not os.path.isabs(p) for p in paths)
    text = tokenizer.apply_chat_template(records[0]["messages"], tokenize=False)
    assert text.count("<|image_pad|>") == sum(1 for m in records[0]["messages"] for p in m["content"]
                                              if p["type"] == "image")
    images = [Image.open(tmp_path / "data" / p).convert("RGB") for p in paths]
    out = Qwen2VLImageProcessorPil.from_pretrained(proc)(images=images, return_tensors="np")
    grids = np.asarray(out["image_grid_thw"])
    assert grids.shape == (len(images), 3) and (grids[:, 0] == 1).all()
    assert np.asarray(out["pixel_values"]).shape == (int(grids.prod(axis=1).sum()), 3 * 2 * 14 * 14)
    assert (grids.prod(axis=1) // 4 <= 128).all()  # the budget given: at most 128 tokens an image
