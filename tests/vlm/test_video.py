"""Videos in conversations (worker/video.py, worker/video_plan.py): planned from each container's
packets without decoding, the sampled frames decoded at delivery with PyAV and resized by the video
processor, sent as uint8 and finished by the trainer client. Checked in the reference environment
(tests/vlm/video_check.py) against the processor's own apply_chat_template, whose videos transformers
decodes with torchcodec, and the models' get_rope_index: Qwen2.5-VL (second_per_grid_ts) and
Qwen3-VL (timestamps), with and without `fps`, on H.264, MPEG-4 and VP9 videos."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from msd.testing.vlm_data import write_qwen2_5_vl_processor, write_qwen3_vl_processor, write_video_config
from tests.vlm.conftest import REFERENCE_PYTHON, ROOT, torchcodec_env

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    if not os.path.exists(REFERENCE_PYTHON):
        pytest.fail(f"no reference environment at {REFERENCE_PYTHON}: run `make .venv-vlm`")
    root = tmp_path_factory.mktemp("video")
    q25 = write_video_config(write_qwen2_5_vl_processor(str(root / "q25"), max_pixels=20_000), "qwen2_5_vl", 12_000)
    q3 = write_video_config(write_qwen3_vl_processor(str(root / "q3"), max_pixels=40_000), "qwen3_vl", 200_000)
    work = root / "work"
    work.mkdir()
    out = subprocess.run([REFERENCE_PYTHON, os.path.join(ROOT, "tests", "vlm", "video_check.py"), q25, q3, str(work)],
                         check=True, capture_output=True, text=True, timeout=360, env=torchcodec_env(str(root / "ff")))
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_videos_equal_apply_chat_template_token_mask_pixel_and_position(checked):
    results = checked["results"]
    assert {(r["family"], r["fps"]) for r in results} == {("qwen2_5_vl", 2.0), ("qwen2_5_vl", None),
                                                           ("qwen3_vl", None), ("qwen3_vl", 4.0)}
    for r in results:
        assert r["problem"] is None, r
        for what in ("tokens", "mask", "grid", "seconds", "pixels", "torch", "one_array", "positions"):
            assert r[what], (what, r)
    # a video with a display rotation (a phone's) is sampled, sized and decoded upright, as transformers'
    # loader reads it: its grid is taller than wide although its frames are coded 160 x 96
    rotated = [r for r in results if r["rotated"]]
    assert len(rotated) == 4 and all(r["grids"][0][1] > r["grids"][0][2] for r in rotated), rotated
    # sampling by fps took fewer frames than the whole video (Qwen2.5-VL samples every frame unasked)
    whole = {r["grids"][0][0] for r in results if r["family"] == "qwen2_5_vl" and r["fps"] is None}
    sampled = {r["grids"][0][0] for r in results if r["family"] == "qwen2_5_vl" and r["fps"] == 2.0}
    assert max(sampled) < min(whole)


def test_videos_travel_as_uint8_at_a_quarter_of_the_float_bytes(checked):
    for r in checked["results"]:
        assert r["wire_bytes"] == r["planned_bytes"]  # the ahead budget counts what is sent
        assert r["float_bytes"] == 4 * r["wire_bytes"]


def test_bad_and_long_videos_skip_their_record_before_planning(checked):
    refused = checked["refused"]
    assert refused["corrupt"][0] == "corrupt" and "corrupt.mp4" in refused["corrupt"][1]
    assert refused["truncated"][0] == "corrupt" and "truncated.mp4" in refused["truncated"][1]
    assert refused["missing"][0] == "corrupt" and "no such video file" in refused["missing"][1]
    assert refused["too_long"] == ["over_limit", "messages[0].content[0]: " + refused["too_long"][1].split(": ", 1)[1]]
    assert "over max_video_s (2)" in refused["too_long"][1]


def test_videos_named_by_bytes_a_videos_list_or_webdataset_entries_make_the_same_sample(checked):
    assert checked["forms"] == {"bytes": True, "videos_list": True, "webdataset": True}


def test_a_job_serves_videos_to_its_ranks_as_the_processor_makes_them(tmp_path):
    """Real processes (coordinator, 2 worker processes, 2 ranks, rank 1 finishing on a torch
    device) in the reference environment, where workers have torchvision and PyAV: every piece
    equals apply_chat_template of its record; the corrupt and the too long video skip their
    records, named with their kind and line."""
    if not os.path.exists(REFERENCE_PYTHON):
        pytest.fail(f"no reference environment at {REFERENCE_PYTHON}: run `make .venv-vlm`")
    q25 = write_video_config(write_qwen2_5_vl_processor(str(tmp_path / "q25"), max_pixels=20_000), "qwen2_5_vl",
                             12_000)
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run([REFERENCE_PYTHON, os.path.join(ROOT, "tests", "vlm", "video_job.py"), q25, str(work)],
                         capture_output=True, text=True, timeout=360, env=torchcodec_env(str(tmp_path / "ff")))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["steps"] == {"0": 5, "1": 5}
    assert result["problems"] == [] and result["pieces"] >= 20 and result["videos"] >= 20, result
    assert result["bad_records_seen"] == []
    assert set(result["records_seen"]) == set(range(14)) - {5, 9}
    assert [tuple(s) for s in result["skipped"]] == [("corrupt", 6), ("over_limit", 10)]
