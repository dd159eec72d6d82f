"""InternVL: each image is cut into the 448-pixel tiles of the canvas of closest aspect (1 to 12)
plus a thumbnail where there are several, 256 tokens a tile between <img> and </img>; its
`pixel_values` are [tiles, 3, 448, 448]. Planned from image sizes (its tiles sent as uint8), through
real workers and ranks, checked against transformers' AutoProcessor in the reference environment:
token, mask and pixel."""

from __future__ import annotations

import numpy as np
import pytest

from msd.testing.vlm_data import write_image_conversations, write_internvl_processor
from msd_common.doc_keys import split_doc_key
from tests.vlm.conftest import check_text, pieces_of, run_image_job, token_id, write_notes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

TILE_TOKENS = 256


@pytest.fixture(scope="module")
def internvl_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("internvl")
    processor = write_internvl_processor(str(root / "internvl"))
    write_image_conversations(str(root / "data"), 10, seed=3, sizes=(40, 700), max_images=1)
    write_notes(str(root), 20)
    return (*run_image_job(root, processor, seed=8, pad_token="<|endoftext|>", steps=3, seq_len=8192),
            token_id(processor, "<IMG_CONTEXT>"))


def test_samples_equal_transformers_internvl_processor(internvl_run):
    from trainer_client.batch import BATCH_KEYS

    received, ref, log, context_token = internvl_run
    schema = {k.key for k in BATCH_KEYS}
    checked = several = 0
    for batches in received.values():
        for b in batches:
            assert set(b) - {"received_at"} <= schema, set(b) - schema
            for row, start, key, n, k, tile in pieces_of(b):
                source, record = split_doc_key(key)
                tiles = int(b["images_per_sample"][k])
                if source == 1:
                    assert tiles == 0
                    continue
                expected = ref[record]
                span = slice(start, start + n)
                check_text(b, row, span, expected)
                assert tiles == len(expected["pixel_values"]) > 0
                assert int((expected["input_ids"] == context_token).sum()) == TILE_TOKENS * tiles
                np.testing.assert_array_equal(np.asarray(b["pixel_values"])[tile:tile + tiles],
                                              expected["pixel_values"])
                several += tiles > 1
                checked += 1
    assert checked >= 6 and several > 0
    assert "exited with" not in log
