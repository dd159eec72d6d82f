"""A padded family: LLaVA-NeXT (anyres) resizes an image to the best of its grid pinpoints, cuts it
into 336-pixel patches and adds the image resized whole; its `pixel_values` are [images, patches,
3, 336, 336], padded with zeros to the sample's most patches, beside `image_sizes`. Planned from
image sizes (its patches sent as uint8, without the padding) or run whole at prepare time, through
real workers and ranks, micro-batches of two rows: every piece's images padded to the micro-batch's
most patches, as transformers pads a batch.
Checked against transformers' AutoProcessor in the reference environment: token, mask, image sizes
and pixel. Before, such a micro-batch stalled (its samples' pixel values differ in shape)."""

from __future__ import annotations

import pytest

from msd.testing.vlm_data import write_image_conversations, write_llava_next_processor
from tests.vlm.conftest import check_anyres, run_image_job, write_notes

pytestmark = [pytest.mark.integration, pytest.mark.timeout(500)]

RECORDS = 10


@pytest.fixture(scope="module", params=["delivery", "prepare"])
def llava_run(tmp_path_factory, request):
    root = tmp_path_factory.mktemp("llava_next")
    processor = write_llava_next_processor(str(root / "llava"))
    write_image_conversations(str(root / "data"), RECORDS, seed=5, sizes=(300, 900), max_images=1)
    write_notes(str(root), 20)
    return run_image_job(root, processor, seed=7, pad_token="<unk>", steps=3, seq_len=8192, micro_batch_size=2,
                         source={"image_pass": request.param})


def test_samples_equal_transformers_llava_next_processor_padded_across_the_micro_batch(llava_run):
    checked, padded = check_anyres(*llava_run)
    assert checked >= 6 and padded > 0, (checked, padded)
