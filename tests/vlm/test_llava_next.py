"""A padded family: LLaVA-NeXT (anyres) resizes an image to the best of its grid pinpoints, cuts it
into 336-pixel patches and adds the image resized whole; its `pixel_values` are [images, patches,
3, 336, 336], padded with zeros to the sample's most patches, beside `image_sizes`. Planned from
image sizes (its patches sent as uint8, without the padding) or run whole at prepare time, through
real workers and ranks, micro-batches of two rows: every piece's images padded to the micro-batch's
most patches, as transformers pads a batch.
Checked against transformers' AutoProcessor in the reference environment: token, mask, image sizes
and pixel. Before, such a micro-batch stalled (its samples' pixel values differ in shape)."""

from __future__ import annotations

import numpy as np
import pytest

from msd.testing.vlm_data import write_image_conversations, write_llava_next_processor
from msd_common.doc_keys import split_doc_key
from tests.vlm.conftest import check_text, pieces_of, run_image_job, write_notes

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
    from trainer_client.batch import BATCH_KEYS

    received, ref, log = llava_run
    schema = {k.key for k in BATCH_KEYS}
    checked = padded = 0
    for batches in received.values():
        for b in batches:
            assert set(b) - {"received_at"} <= schema, set(b) - schema
            images_seen = 0
            for row, start, key, n, k, image in pieces_of(b):
                source, record = split_doc_key(key)
                images = int(b["images_per_sample"][k])
                images_seen += images
                if source == 1:
                    assert images == 0
                    continue
                expected = ref[record]
                span = slice(start, start + n)
                check_text(b, row, span, expected)
                want = expected["pixel_values"]  # [images, patches, 3, 336, 336]
                assert images == len(want) > 0
                got = np.asarray(b["pixel_values"])[image:image + images]
                np.testing.assert_array_equal(got[:, :want.shape[1]], want)
                assert not got[:, want.shape[1]:].any()  # the micro-batch's padding: zeros
                padded += got.shape[1] > want.shape[1]
                np.testing.assert_array_equal(b["image_sizes"][image:image + images], expected["image_sizes"])
                checked += 1
            if images_seen:
                assert len(b["pixel_values"]) == images_seen
    assert checked >= 6 and padded > 0, (checked, padded)
    assert "exited with" not in log
