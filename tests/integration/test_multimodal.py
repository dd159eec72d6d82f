"""Image-text (WebDataset) and Parquet sources through the whole path: real tar shards of JPEG,
PNG and WebP images, a real Parquet file, worker processes, trainer processes."""

import numpy as np
import pytest

from msd_common.spec import load_job
from msd.testing.multimodal_data import captions, write_parquet, write_webdataset
from tests.conftest import write_job
from msd_common.doc_keys import doc_key, split_doc_key
from worker.samples import open_source

from .harness import check_content, run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

IMAGE_TOKEN = 300
STEPS = 12


@pytest.fixture(scope="module")
def mm_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("mm")
    (root / "images").mkdir()
    write_webdataset(str(root / "images" / "img-000.tar"), 40, seed=1, sizes=(48, 160),
                     broken={4: "bad_image", 9: "no_caption"})
    write_webdataset(str(root / "images" / "img-001.tar"), 40, seed=2, sizes=(48, 160))
    write_parquet(str(root / "text.parquet"), captions()[:400], row_group_size=50)
    job = {
        "seed": 7,
        "sources": {
            "text": {"format": "parquet", "paths": ["text.parquet"], "text_key": "text"},
            "images": {"format": "webdataset", "paths": ["images/*.tar"], "image_token_id": IMAGE_TOKEN,
                       "max_pixels": 64 * 64, "patch_size": 16},
        },
        "batch": {"seq_len": 512, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"text": 0.5, "images": 0.5}},
        "balance": {"cost": {"quadratic": 1.0, "linear": 0.0, "patch_quadratic": 50.0, "patch_linear": 0.0}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 8, "lookahead_steps": 3},
    }
    path = write_job(str(root), job, "mm.yaml")
    log = str(root / "mm.log")
    return path, run_job(path, workers=2, ranks=2, steps=STEPS, log_path=log), log


def test_tokens_of_every_piece_match_the_sources(mm_job):
    path, received, _ = mm_job
    assert all(len(b) == STEPS * 2 for b in received.values())
    assert check_content(path, received) > 50


def test_batches_carry_the_patches_of_their_placeholders(mm_job):
    path, received, _ = mm_job
    job = load_job(path)
    images = open_source(job.worker_job().sources[1])
    seen_images = 0
    for batches in received.values():
        for b in batches:
            patches, per_image, where = b["pixel_patches"], b["patches_per_image"], b["image_positions"]
            assert patches.dtype == np.uint8 and patches.shape[1] == 16 * 16 * 3
            assert len(patches) == int(per_image.sum()) == len(where)
            # every placeholder has a patch, and every patch sits on a placeholder
            assert (b["tokens"][where[:, 0], where[:, 1]] == IMAGE_TOKEN).all()
            assert int((b["tokens"] == IMAGE_TOKEN).sum()) == len(where)
            # the patches are the worker's decode of exactly those samples, in packing order
            expected = []
            for key, off, n in zip(b["doc_keys"].tolist(), b["doc_offsets"].tolist(), b["piece_lengths"].tolist()):
                if split_doc_key(key)[0] == 1:
                    own = images.read_sample(split_doc_key(key)[1])[1]
                    if off < len(own):
                        expected.append(own[off: off + n])
                        seen_images += 1
            got = np.concatenate(expected) if expected else np.zeros((0, 768), np.uint8)
            np.testing.assert_array_equal(patches, got)
            assert per_image.tolist() == [len(e) for e in expected]
    assert seen_images > 20


def test_broken_samples_are_skipped_and_named(mm_job):
    _, received, log = mm_job
    keys = {k for bs in received.values() for b in bs for k in b["doc_keys"].tolist()}
    assert not keys & {doc_key(1, 4), doc_key(1, 9)}
    text = open(log).read()
    assert "img-000.tar: sample '000004': image does not decode" in text
    assert "img-000.tar: sample '000009': no caption entry" in text
