"""LLaVA-OneVision (anyres, as LLaVA-NeXT): a sample's one image is cut into 384-pixel patches of its
best grid pinpoint and resized whole as one more; several images in a sample are each resized whole,
one patch each, and `batch_num_images` says how many a sample holds. Planned from image sizes (its
patches sent as uint8 without the processor's padding), through real workers and ranks, micro-batches
of two rows, conversations of one image and of two. Checked against transformers' AutoProcessor in
the reference environment: token, mask, image sizes, images per sample and pixel."""

from __future__ import annotations

import pytest

from msd.testing.vlm_data import write_image_conversations, write_llava_onevision_processor
from tests.vlm.conftest import check_anyres, run_image_job, write_notes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

RECORDS = 10


def test_samples_equal_transformers_llava_onevision_processor_one_image_cut_several_whole(tmp_path):
    processor = write_llava_onevision_processor(str(tmp_path / "onevision"))
    records = write_image_conversations(str(tmp_path / "data"), RECORDS, seed=11, sizes=(200, 700), max_images=2)
    write_notes(str(tmp_path), 20)
    received, ref, log = run_image_job(tmp_path, processor, seed=7, pad_token="<|endoftext|>", steps=3,
                                       seq_len=16384, micro_batch_size=2)
    counts = {len(r["pixel_values"]) for r in ref.values() if "pixel_values" in r}
    assert {1, 2} <= counts, counts  # samples of one image (cut) and of several (whole) are both in the data
    checked, padded = check_anyres(received, ref, log)
    assert checked >= 6 and padded > 0, (checked, padded)
    assert len(records) == RECORDS
