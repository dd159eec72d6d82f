"""A second family, with another image scheme: Gemma 3 resizes every image to 896 x 896 and gives
it a fixed 256 image tokens (between <start_of_image> and <end_of_image>), with token_type_ids
marking them, and plain (1-D) positions. Through real workers and ranks, checked against
transformers' AutoProcessor in the reference environment: token, mask, token type and pixel."""

from __future__ import annotations


import numpy as np
import pytest

from msd.testing.vlm_data import write_gemma3_processor, write_image_conversations
from msd_common.doc_keys import split_doc_key
from tests.vlm.conftest import check_text, pieces_of, run_image_job, write_notes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

RECORDS = 10
IMAGE_TOKENS = 256


@pytest.fixture(scope="module")
def gemma_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3")
    processor = write_gemma3_processor(str(root / "gemma"))
    write_image_conversations(str(root / "data"), RECORDS, seed=8, sizes=(40, 300), max_images=1)
    write_notes(str(root), 20)
    return run_image_job(root, processor, seed=4, pad_token="<pad>", steps=4)


def test_samples_equal_transformers_gemma3_processor(gemma_run):
    from trainer_client.batch import BATCH_KEYS

    received, ref, log = gemma_run
    schema = {k.key for k in BATCH_KEYS}
    checked = images_checked = texts = 0
    for batches in received.values():
        for b in batches:
            assert set(b) - {"received_at"} <= schema, set(b) - schema
            assert b["position_ids"].shape == b["tokens"].shape  # plain positions: no mrope
            images_seen = 0
            for row, start, key, n, k, image in pieces_of(b):
                source, record = split_doc_key(key)
                images = int(b["images_per_sample"][k])
                images_seen += images
                span = slice(start, start + n)
                np.testing.assert_array_equal(b["position_ids"][row, span], np.arange(n))
                if source == 1:
                    assert images == 0
                    texts += 1
                    continue
                expected = ref[record]
                check_text(b, row, span, expected)
                np.testing.assert_array_equal(b["token_type_ids"][row, span], expected["token_type_ids"])
                assert int(expected["token_type_ids"].sum()) == IMAGE_TOKENS * images
                assert images == len(expected["pixel_values"]) > 0
                np.testing.assert_array_equal(b["pixel_values"][image:image + images],
                                              expected["pixel_values"])  # [images, 3, 896, 896]
                images_checked += images
                checked += 1
            assert images_seen == len(b.get("pixel_values", ()))
            # no label is an image token
            assert not (b["loss_mask"][:, :-1] * (b.get("token_type_ids", 0 * b["tokens"]) == 1)[:, 1:]).any()
    assert checked >= 8 and images_checked >= 8 and texts > 0
    assert "exited with" not in log
