"""Conversations with images through real workers and ranks, made by Qwen2.5-VL's own processor
(`processor: DIR`), checked against transformers' AutoProcessor in the reference environment
(tests/vlm/conftest.py): token for token, mask for mask, pixel for pixel, position for position.
Spoiled images (corrupt, truncated, oversized, missing) skip their records, never the job; a text
source beside them gets plain positions on all three rows."""

from __future__ import annotations


import numpy as np
import pytest

from msd.testing.vlm_data import spoil_images, write_image_conversations, write_qwen2_5_vl_processor
from msd_common.doc_keys import split_doc_key
from tests.conftest import write_job
from tests.integration.harness import run_job
from tests.vlm.conftest import pieces_of, reference, token_id, write_notes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

RECORDS = 40
SPOILED = {3: "corrupt", 7: "truncated", 11: "oversized", 15: "missing"}
SEQ_LEN = 2048


@pytest.fixture(scope="module")
def vlm_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("vlm")
    processor = write_qwen2_5_vl_processor(str(root / "qwen"), max_pixels=100_000)
    records = write_image_conversations(str(root / "data"), RECORDS, seed=3, sizes=(40, 240), max_images=2)
    spoil_images(str(root / "data"), records, SPOILED)
    write_notes(str(root), 30)
    pad_id = token_id(processor, "<|endoftext|>")
    job = {
        "seed": 11,
        "sources": {
            "vqa": {"format": "jsonl", "paths": ["data/conversations.jsonl"], "processor": "qwen",
                    "max_image_pixels": 1_000_000},
            "notes": {"format": "jsonl", "paths": ["text/notes.jsonl"], "packing": "whole"},
        },
        "batch": {"seq_len": SEQ_LEN, "micro_batch_size": 2, "global_batch_size": 8, "pad_id": pad_id},
        "topology": {"dp": 2},
        "mixture": {"weights": {"vqa": 0.8, "notes": 0.2}},
        "balance": {"cost": {"quadratic": 1.0, "linear": 0.0, "patch_linear": 100.0}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 8, "lookahead_steps": 2},
    }
    path = write_job(str(root), job)
    log = str(root / "job.log")
    # rank 1's client makes its pixel values with torch on a device (device="cpu" here), rank 0's with numpy
    received = run_job(path, workers=2, ranks=2, steps=6, log_path=log, timeout_s=300, devices={1: "cpu"})
    ref = reference(processor, str(root / "data" / "conversations.jsonl"), str(root / "ref.npz"))
    return received, ref, open(log).read()


def _samples(received):
    """Every piece of every micro-batch: (batch, row, start, doc_key, length, piece, index of its first image)."""
    for batches in received.values():
        for b in batches:
            for piece in pieces_of(b):
                yield (b, *piece)


def test_samples_equal_transformers_processor_token_mask_pixel_and_position(vlm_run):
    received, ref, _ = vlm_run
    checked_images = checked = texts = 0
    for b, row, start, key, n, k, image in _samples(received):
        source, record = split_doc_key(key)
        positions = b["position_ids"]
        assert positions.shape == (3, *b["tokens"].shape)
        if source == 1:  # a text sample: its plain positions on all three rows
            for r in range(3):
                np.testing.assert_array_equal(positions[r, row, start:start + n], np.arange(n))
            assert b["images_per_sample"][k] == 0
            texts += 1
            continue
        expected = ref[record]
        assert "error" not in expected, expected.get("error")
        tokens = b["tokens"][row, start:start + n]
        np.testing.assert_array_equal(tokens, expected["input_ids"])  # whole, image tokens expanded
        mask = b["loss_mask"][row, start:start + n]
        np.testing.assert_array_equal(mask[:-1], expected["assistant_masks"][1:])  # position i predicts i+1
        assert mask[-1] == 0 and mask.sum() > 0
        np.testing.assert_array_equal(positions[:, row, start:start + n], expected["position_ids"])
        images = int(b["images_per_sample"][k])
        assert images == len(expected.get("image_grid_thw", ()))
        if images:
            grids = b["image_grid_thw"][image:image + images]
            np.testing.assert_array_equal(grids, expected["image_grid_thw"])
            patches_before = int(b["image_grid_thw"][:image].prod(axis=1).sum())
            pixels = b["pixel_values"][patches_before:patches_before + int(grids.prod(axis=1).sum())]
            np.testing.assert_array_equal(pixels, expected["pixel_values"])  # pixel for pixel
            checked_images += images
        checked += 1
    assert checked > 30 and checked_images > 30 and texts > 0


def test_micro_batch_arrays_are_whole_and_in_packing_order(vlm_run):
    from trainer_client.batch import BATCH_KEYS

    schema = {k.key for k in BATCH_KEYS}
    received, _, _ = vlm_run
    for batches in received.values():
        for b in batches:
            assert set(b) - {"received_at"} <= schema, set(b) - schema  # (received_at: the harness's own)
            grids = b.get("image_grid_thw", np.zeros((0, 3), np.int64))
            assert int(b["images_per_sample"].sum()) == len(grids)
            if len(grids):
                assert b["pixel_values"].shape == (int(grids.prod(axis=1).sum()), 1176)
                assert b["pixel_values"].dtype == np.float32
                # each image's tokens: grid / merge^2 of them, every one masked out of the loss
                image_tokens = b["mm_token_type_ids"] == 1
                assert int(image_tokens.sum()) == int(grids.prod(axis=1).sum()) // 4
                # no label is an image token (loss_mask[i] masks token i + 1)
                assert not (b["loss_mask"][:, :-1] * image_tokens[:, 1:]).any()
            assert int(b["piece_lengths"].sum()) == b["num_tokens"] <= b["tokens"].size


def test_spoiled_images_skip_their_records_and_the_job_goes_on(vlm_run):
    received, ref, log = vlm_run
    seen = {split_doc_key(k) for batches in received.values() for b in batches for k in b["doc_keys"].tolist()}
    vqa = {r for s, r in seen if s == 0}
    assert not vqa & set(SPOILED), "a record with a spoiled image was trained on"
    assert vqa == set(range(RECORDS)) - set(SPOILED), "every good record came through"
    for i in SPOILED:
        if SPOILED[i] != "oversized":  # (the reference has no pixel limit of its own)
            assert "error" in ref[i]
    assert "image does not decode" in log and "no such image file" in log
    assert "over max_image_pixels" in log
    assert "exited with" not in log, "no worker process died"
