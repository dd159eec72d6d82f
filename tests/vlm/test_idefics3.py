"""A tiled family: Idefics3 (SmolVLM's first models ship its processor; SmolVLM2's own class, SmolVLMProcessor,
checked here too) resizes an image's longest
edge, cuts it into square tiles (rows x columns, each marked <row_i_col_j> in the text) and adds the
image resized whole as a global view; its pixel values are a batch of one, [1, tiles, 3, S, S], with
a pixel mask beside them. Planned from image sizes, its tiles sent as uint8 and finished by the
client (on the CPU, and on a torch device for rank 1), or run whole at prepare time; micro-batches
of two rows, so that samples with different tile counts share one. Through real workers and ranks,
checked against transformers' AutoProcessor in the reference environment: token, mask and pixel."""

from __future__ import annotations

import numpy as np
import pytest

from msd.testing.vlm_data import write_idefics3_processor, write_image_conversations, write_smolvlm_processor
from msd_common.doc_keys import split_doc_key
from tests.vlm.conftest import check_text, pieces_of, run_image_job, token_id, write_notes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

RECORDS = 10
# family -> (processor writer, tile side, image tokens a tile, pad token): Idefics3's published 364-pixel
# tiles; SmolVLM2's processor class (SmolVLMProcessor), its 384-pixel tiles
FAMILIES = {"idefics3": (write_idefics3_processor, 364, 169, "<|end_of_text|>"),
            "smolvlm": (write_smolvlm_processor, 384, 81, "<|im_end|>")}


@pytest.fixture(scope="module", params=[("idefics3", "delivery"), ("idefics3", "prepare"), ("smolvlm", "delivery")],
                ids="-".join)
def idefics3_run(tmp_path_factory, request):
    """image_pass delivery: planned from sizes, tiles as uint8; prepare: the processor run whole at
    prepare time, its float tiles sent (before, micro-batches of its samples stalled: each sample's
    pixel values a batch of one of its own tile count)."""
    family, image_pass = request.param
    write, tile, image_tokens, pad = FAMILIES[family]
    root = tmp_path_factory.mktemp(family)
    processor = write(str(root / family), longest_edge=2 * tile)  # up to 2 x 2 tiles
    write_image_conversations(str(root / "data"), RECORDS, seed=9, sizes=(40, 500), max_images=2)
    write_notes(str(root), 20)
    return (*run_image_job(root, processor, seed=6, pad_token=pad, steps=4, micro_batch_size=2,
                           source={"image_pass": image_pass}, devices={1: "cpu"}),
            token_id(processor, "<image>"), tile, image_tokens)


def test_samples_equal_transformers_idefics3_processor(idefics3_run):
    from trainer_client.batch import BATCH_KEYS

    received, ref, log, image_token, tile_side, image_tokens = idefics3_run
    schema = {k.key for k in BATCH_KEYS}
    checked = shared = texts = 0
    for batches in received.values():
        for b in batches:
            assert set(b) - {"received_at"} <= schema, set(b) - schema
            tiles_seen, samples_with_images = 0, 0
            for row, start, key, n, k, tile in pieces_of(b):
                source, record = split_doc_key(key)
                tiles = int(b["images_per_sample"][k])
                tiles_seen += tiles
                span = slice(start, start + n)
                if source == 1:
                    assert tiles == 0
                    texts += 1
                    continue
                expected = ref[record]
                check_text(b, row, span, expected)
                want = expected["pixel_values"]  # [1, tiles, 3, S, S]
                assert tiles == want.shape[1] > 0
                assert int((expected["input_ids"] == image_token).sum()) == image_tokens * tiles
                np.testing.assert_array_equal(np.asarray(b["pixel_values"])[:, tile:tile + tiles], want)
                np.testing.assert_array_equal(b["pixel_attention_mask"][:, tile:tile + tiles],
                                              expected["pixel_attention_mask"])
                samples_with_images += 1
                checked += 1
            if samples_with_images:
                pixels = np.asarray(b["pixel_values"])
                assert pixels.dtype == np.float32 and pixels.shape == (1, tiles_seen, 3, tile_side, tile_side)
                assert b["pixel_attention_mask"].dtype == np.bool_
                assert b["pixel_attention_mask"].shape == (1, tiles_seen, tile_side, tile_side)
                shared += samples_with_images > 1
    assert checked >= 8 and texts > 0
    assert shared > 0, "no micro-batch held two samples with images"
    assert "exited with" not in log

