"""What transformers' own processor makes of each conversation of a JSONL file, run in the
reference environment (.venv-vlm: transformers with torch and torchvision, where AutoProcessor builds
the Qwen-VL processors whole). Not imported by the tests: run as a script by tests/vlm/conftest.py.

    .venv-vlm/bin/python tests/vlm/reference.py PROCESSOR_DIR CONVERSATIONS.jsonl OUT.npz [BACKEND]

For each record i: every array the processor returns (i/input_ids, i/assistant_masks, and the
per-token ones such as token_type_ids, as [n]; i/pixel_values, i/image_grid_thw as they come),
for the Qwen-VL processors i/position_ids (the model's own get_rope_index, [3, n]); or i/error (why
the processor refused it). BACKEND ("pil" by default) is the image processor's, as `image_backend` in a job.
"""

import functools
import os
import sys
from types import SimpleNamespace

import numpy as np
import json
import torch  # noqa: F401  (loaded before transformers, as the trainer does)
from transformers import AutoImageProcessor, AutoProcessor
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel


def main(processor_dir: str, conversations: str, out: str, backend: str = "pil") -> None:
    image_processor = AutoImageProcessor.from_pretrained(processor_dir, backend=backend)
    processor = AutoProcessor.from_pretrained(processor_dir, image_processor=image_processor)
    mrope = type(processor).__name__.startswith("Qwen")
    model = SimpleNamespace(config=SimpleNamespace(vision_config=SimpleNamespace(
        spatial_merge_size=getattr(image_processor, "merge_size", 2), tokens_per_second=2)))
    model.get_vision_position_ids = functools.partial(Qwen2_5_VLModel.get_vision_position_ids, model)
    base = os.path.dirname(os.path.abspath(conversations))
    arrays = {}
    with open(conversations, "rb") as f:
        records = [json.loads(line) for line in f]
    for i, record in enumerate(records):
        messages = [{**m, "content": [{**p, "image": os.path.join(base, p["image"])} if p.get("type") == "image"
                                      else p for p in m["content"]]} if isinstance(m["content"], list) else m
                    for m in record["messages"]]
        try:
            out_ = processor.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                 return_assistant_tokens_mask=True, return_tensors="pt")
        except Exception as e:  # noqa: BLE001 - recorded: the test expects such a record skipped
            arrays[f"{i}/error"] = np.array(f"{type(e).__name__}: {e}")
            continue
        ids = out_["input_ids"]
        if mrope:
            positions, _ = Qwen2_5_VLModel.get_rope_index(model, ids, out_["mm_token_type_ids"].int(),
                                                          image_grid_thw=out_.get("image_grid_thw"))
            arrays[f"{i}/position_ids"] = positions[:, 0].numpy()
        for name, value in out_.items():
            if name == "attention_mask":
                continue
            value = np.asarray(value)
            per_token = value.ndim == 2 and value.shape == tuple(ids.shape)
            arrays[f"{i}/{name}"] = value[0] if per_token else value
    np.savez(out, **arrays)


if __name__ == "__main__":
    main(*sys.argv[1:])
