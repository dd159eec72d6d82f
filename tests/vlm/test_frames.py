"""Frames as bytes (msd_common/frames.py): a worker sends each image's resized uint8 frame and the
trainer client finishes it into the processor's pixel values. Checked in the reference environment
(transformers with torch and torchvision) on both image backends, for Qwen2.5-VL (patch layout,
temporal repeat), Gemma 3 (one size, no repeat), Idefics3 and SmolVLM2 (square tiles, a batch of one), the
LLaVA models (patches) and InternVL (tiles): finished
with numpy and with torch, bit for bit what the image processor gives run whole, at an eighth (Qwen-VL)
and a quarter (the others; the LLaVA models' padding patches are not sent) of its bytes."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from msd.testing.vlm_data import (write_gemma3_processor, write_idefics3_processor, write_internvl_processor,
                                  write_llava_next_processor, write_llava_onevision_processor,
                                  write_qwen2_5_vl_processor, write_smolvlm_processor)
from tests.vlm.conftest import REFERENCE_PYTHON, ROOT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def processors(tmp_path_factory):
    root = tmp_path_factory.mktemp("frames")
    return {"qwen2_5_vl": write_qwen2_5_vl_processor(str(root / "qwen"), max_pixels=1_000_000),
            "gemma3": write_gemma3_processor(str(root / "gemma")),
            "idefics3": write_idefics3_processor(str(root / "idefics3")),
            "smolvlm": write_smolvlm_processor(str(root / "smolvlm")),
            "llava_next": write_llava_next_processor(str(root / "llava_next")),
            "llava_onevision": write_llava_onevision_processor(str(root / "llava_onevision")),
            "internvl": write_internvl_processor(str(root / "internvl"))}


@pytest.fixture(scope="module")
def checked(processors):
    """frames_check.py's result for every family on a backend, from one process a backend."""
    if not os.path.exists(REFERENCE_PYTHON):
        pytest.fail(f"no reference environment at {REFERENCE_PYTHON}: run `make .venv-vlm`")
    by_backend: dict[str, dict] = {}

    def result(backend: str, family: str) -> dict:
        if backend not in by_backend:
            out = subprocess.run([REFERENCE_PYTHON, os.path.join(ROOT, "tests", "vlm", "frames_check.py"), backend,
                                  *processors.values()], check=True, capture_output=True, text=True, timeout=280)
            lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
            assert len(lines) == len(processors), out.stdout[-2000:]
            by_backend[backend] = dict(zip(processors, lines))
        return by_backend[backend][family]

    return result


@pytest.mark.parametrize("backend", ["pil", "torchvision"])
@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3", "idefics3", "smolvlm", "llava_next", "llava_onevision",
                                    "internvl"])
def test_frames_finished_by_the_client_equal_the_image_processor(checked, family, backend):
    result = checked(backend, family)
    assert result["frame_dtype"] == "uint8"
    assert result["numpy_equal"] and result["torch_equal"], result
    if family.startswith("llava"):  # their padding patches are not sent
        assert result["pixel_bytes"] >= result["frame_bytes"] * 4
    else:
        assert result["pixel_bytes"] == result["frame_bytes"] * (8 if family == "qwen2_5_vl" else 4)
    if family in ("idefics3", "smolvlm"):  # tiles planned from sizes as the image pass cuts them; the mask all ones
        assert result["plan_equal"] and result["mask_equal"], result
