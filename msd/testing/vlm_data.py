"""Vision-language data for tests, made here (no download): a Qwen2.5-VL processor directory that
transformers' AutoProcessor loads as the published model's (where torchvision is installed; the
image processor alone loads anywhere), and conversations whose turns hold images.

The processor directory: a byte-level BPE tokenizer trained here with the Qwen special tokens (as
added special tokens, so that `<|image_pad|>` stays one id), the published Qwen2.5-VL image
processor configuration, and TRL's training chat template (its `{% generation %}` marks give the
assistant mask).
"""

from __future__ import annotations

import os
import random
from importlib import resources
from typing import Any

import orjson

from .chat_data import WORDS, train_bpe

QWEN_VL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                   "<|image_pad|>", "<|video_pad|>"]

# Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json
QWEN2_5_VL_PREPROCESSOR: dict[str, Any] = {
    "min_pixels": 3136,
    "max_pixels": 12845056,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


GEMMA3_SPECIAL = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>",
                  "<image_soft_token>"]

# google/gemma-3-4b-it's preprocessor_config.json and processor_config.json: every image is
# resized to 896 x 896 and becomes 256 image tokens (a fixed count, no grid)
GEMMA3_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": None,
    "do_normalize": True,
    "do_pan_and_scan": None,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Gemma3ImageProcessor",
    "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5],
    "pan_and_scan_max_num_crops": None,
    "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None,
    "processor_class": "Gemma3Processor",
    "resample": 2,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 896, "width": 896},
}
GEMMA3_PROCESSOR = {"image_seq_length": 256, "processor_class": "Gemma3Processor"}


def trl_template(name: str) -> str:
    """A chat template that TRL ships (trl/chat_templates/NAME.jinja)."""
    return resources.files("trl").joinpath("chat_templates", f"{name}.jinja").read_text(encoding="utf-8")


def write_qwen2_5_vl_processor(path: str, vocab_size: int = 600, max_pixels: int | None = None) -> str:
    """A Qwen2.5-VL processor directory at `path` (see the module's docstring). `max_pixels`
    lowers the image budget (tests keep images small); the rest is the published configuration."""
    preprocessor = dict(QWEN2_5_VL_PREPROCESSOR)
    if max_pixels is not None:
        preprocessor["max_pixels"] = max_pixels
    return _write_qwen_dir(path, vocab_size, preprocessor, "qwen2_5_vl_training")


def write_processor_dir(path: str, special: list[str], vocab_size: int, tokenizer_config: dict[str, Any],
                        preprocessor: dict[str, Any], template: str, processor: dict[str, Any] | None = None,
                        video: dict[str, Any] | None = None) -> str:
    """A processor directory at `path` that transformers' AutoProcessor loads: a byte-level BPE
    tokenizer trained here with `special` tokens (added: each stays one id), its configuration, the
    image processor's and (where given) the processor's and the video processor's configuration,
    and a chat template."""
    os.makedirs(path, exist_ok=True)
    train_bpe(special, vocab_size, added=True).save(os.path.join(path, "tokenizer.json"))
    files = [("tokenizer_config.json", {"model_max_length": 1 << 20, **tokenizer_config}),
             ("preprocessor_config.json", preprocessor)]
    if processor is not None:
        files.append(("processor_config.json", processor))
    if video is not None:
        files.append(("video_preprocessor_config.json", video))
    for name, value in files:
        with open(os.path.join(path, name), "wb") as f:
            f.write(orjson.dumps(value, option=orjson.OPT_INDENT_2))
    with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template)
    return path


def _write_qwen_dir(path: str, vocab_size: int, preprocessor: dict[str, Any], template: str) -> str:
    """A Qwen-VL processor directory: a BPE tokenizer trained here with the Qwen special tokens, the
    image processor's configuration, and one of TRL's training templates."""
    config = {"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return write_processor_dir(path, QWEN_VL_SPECIAL, vocab_size, config, preprocessor, trl_template(template))


def write_image_conversations(folder: str, n: int, seed: int = 0, sizes: tuple[int, int] = (40, 400),
                              max_images: int = 3) -> list[dict[str, Any]]:
    """n records {"messages": [...]} in folder/conversations.jsonl whose user turns hold 0 to
    max_images PNG images (content parts {"type": "image", "image": PATH}, PATH relative to the
    file), sides drawn from `sizes`; returns the records."""
    import numpy as np
    from PIL import Image

    rng = random.Random(seed)
    pixels = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "images"), exist_ok=True)
    records = []
    for i in range(n):
        messages: list[dict[str, Any]] = []
        for turn in range(rng.randint(1, 3)):
            content: list[dict[str, Any]] = []
            for j in range(rng.randint(0 if turn else 1, max_images)):
                name = f"images/{i:05d}-{turn}-{j}.png"
                height, width = rng.randint(*sizes), rng.randint(*sizes)
                Image.fromarray(pixels.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(
                    os.path.join(folder, name))
                content.append({"type": "image", "image": name})
            content.append({"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(3, 30)))})
            messages.append({"role": "user", "content": content})
            messages.append({"role": "assistant",
                             "content": [{"type": "text", "text": " ".join(rng.choices(WORDS, k=rng.randint(3, 40)))}]})
        records.append({"messages": messages})
    with open(os.path.join(folder, "conversations.jsonl"), "wb") as f:
        for r in records:
            f.write(orjson.dumps(r) + b"\n")
    return records


def spoil_images(folder: str, records: list[dict[str, Any]], spoiled: dict[int, str]) -> None:
    """Spoil the first image of each record named in `spoiled` (record index -> how): "corrupt"
    (bytes that are no image), "truncated" (the file cut in half), "oversized" (replaced by a
    2000 x 2000 image, over a max_image_pixels below 4 million), "missing" (deleted)."""
    import numpy as np
    from PIL import Image

    for i, how in spoiled.items():
        path = next(os.path.join(folder, part["image"]) for m in records[i]["messages"]
                    if isinstance(m["content"], list) for part in m["content"] if part.get("type") == "image")
        if how == "corrupt":
            with open(path, "wb") as f:
                f.write(b"this is not an image" * 10)
        elif how == "truncated":
            data = open(path, "rb").read()
            with open(path, "wb") as f:
                f.write(data[: len(data) // 2])
        elif how == "oversized":
            Image.fromarray(np.zeros((2000, 2000, 3), np.uint8)).save(path)
        elif how == "missing":
            os.remove(path)
        else:
            raise ValueError(f"unknown spoil {how!r}")


def write_gemma3_processor(path: str, vocab_size: int = 600, pan_and_scan: bool = False) -> str:
    """A Gemma 3 processor directory at `path`: the published image processor and processor
    configuration (896 x 896, 256 tokens an image; with `pan_and_scan`, an image of a wide enough
    aspect also gives crops, each another 256 tokens), a BPE tokenizer trained here with Gemma's
    special tokens, and TRL's gemma3 training template."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
              "pad_token": "<pad>", "add_bos_token": False,
              "extra_special_tokens": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                                       "image_token": "<image_soft_token>"}}
    preprocessor = dict(GEMMA3_PREPROCESSOR)
    if pan_and_scan:
        preprocessor["do_pan_and_scan"] = True
    return write_processor_dir(path, GEMMA3_SPECIAL, vocab_size, config, preprocessor, trl_template("gemma3_training"),
                               GEMMA3_PROCESSOR)


# Qwen/Qwen3-VL-8B-Instruct's preprocessor_config.json and video_preprocessor_config.json
QWEN3_VL_PREPROCESSOR: dict[str, Any] = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen3VLProcessor",
}
QWEN3_VL_VIDEO: dict[str, Any] = {
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "video_processor_type": "Qwen3VLVideoProcessor", "processor_class": "Qwen3VLProcessor",
}


def write_video_config(path: str, family: str, max_pixels: int, fps: float | None = None) -> str:
    """The video processor's configuration (video_preprocessor_config.json) in a Qwen-VL processor
    directory: the published one of `family` ("qwen2_5_vl" or "qwen3_vl"), its pixel budget lowered
    to `max_pixels` (per frame for Qwen2.5-VL, per video for Qwen3-VL) and, where given, sampling at
    `fps` frames per second."""
    if family == "qwen2_5_vl":
        video = {k: v for k, v in QWEN2_5_VL_PREPROCESSOR.items() if k not in ("image_processor_type", "max_pixels")}
        video.update({"max_pixels": max_pixels, "video_processor_type": "Qwen2VLVideoProcessor"})
    else:
        video = {**QWEN3_VL_VIDEO, "size": {**QWEN3_VL_VIDEO["size"], "longest_edge": max_pixels}}
    if fps is not None:
        video.update({"fps": fps, "do_sample_frames": True})
    with open(os.path.join(path, "video_preprocessor_config.json"), "wb") as f:
        f.write(orjson.dumps(video, option=orjson.OPT_INDENT_2))
    return path


def write_qwen3_vl_processor(path: str, vocab_size: int = 600, max_pixels: int | None = None) -> str:
    """A Qwen3-VL processor directory: the published image processor configuration (its budget
    lowered to `max_pixels` where given), a BPE tokenizer trained here with the Qwen special tokens,
    and TRL's Qwen3-VL training template."""
    preprocessor = dict(QWEN3_VL_PREPROCESSOR)
    if max_pixels is not None:
        preprocessor["size"] = {**preprocessor["size"], "longest_edge": max_pixels}
    return _write_qwen_dir(path, vocab_size, preprocessor, "qwen3_vl_training")


IDEFICS3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<fake_token_around_image>", "<image>",
                    "<end_of_utterance>", "<global-img>",
                    *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]

# HuggingFaceM4/Idefics3-8B-Llama3's preprocessor_config.json and processor_config.json: an image is
# resized to 1456 on its longest edge, cut into 364 x 364 tiles (rows x columns) and also resized
# whole to one tile (the global view); 169 image tokens a tile
IDEFICS3_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_image_splitting": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "Idefics3ImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "max_image_size": {"longest_edge": 364},
    "processor_class": "Idefics3Processor",
    "resample": 1,
    "rescale_factor": 0.00392156862745098,
    "size": {"longest_edge": 1456},
}
IDEFICS3_PROCESSOR = {"image_seq_len": 169, "processor_class": "Idefics3Processor"}


def write_idefics3_processor(path: str, vocab_size: int = 600, longest_edge: int | None = None) -> str:
    """An Idefics3 processor directory at `path` (SmolVLM's first models ship the same classes): the
    published image processor and processor configuration (with `longest_edge`, images resized to
    that edge instead of 1456: fewer tiles), a BPE tokenizer trained here with Idefics3's special
    tokens (its row and column markers among them), and TRL's idefics3 training template."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
              "eos_token": "<end_of_utterance>", "pad_token": "<|end_of_text|>"}
    preprocessor = _resized(IDEFICS3_PREPROCESSOR, longest_edge)
    return write_processor_dir(path, IDEFICS3_SPECIAL, vocab_size, config, preprocessor,
                               trl_template("idefics3_training"), IDEFICS3_PROCESSOR)


def _resized(preprocessor: dict[str, Any], longest_edge: int | None) -> dict[str, Any]:
    """A tiling image processor's configuration, resizing images to `longest_edge` where given."""
    return preprocessor if longest_edge is None else {**preprocessor, "size": {"longest_edge": longest_edge}}


SMOLVLM_SPECIAL = ["<|im_start|>", "<|im_end|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
                   "<global-img>", *[f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]]

# HuggingFaceTB/SmolVLM2-2.2B-Instruct's preprocessor_config.json and processor_config.json (the
# SmolVLM processor classes, Idefics3's tiling): an image resized to 1536 on its longest edge, cut
# into 384 x 384 tiles and resized whole to one tile; 81 image tokens a tile; videos sampled at 1
# frame a second, at most 64
SMOLVLM_PREPROCESSOR: dict[str, Any] = {
    **IDEFICS3_PREPROCESSOR,
    "image_processor_type": "SmolVLMImageProcessor",
    "max_image_size": {"longest_edge": 384},
    "processor_class": "SmolVLMProcessor",
    "size": {"longest_edge": 1536},
    "video_sampling": {"fps": 1, "max_frames": 64, "video_size": {"longest_edge": 384}},
}
SMOLVLM_PROCESSOR = {"image_seq_len": 81, "processor_class": "SmolVLMProcessor"}
SMOLVLM_VIDEO: dict[str, Any] = {**SMOLVLM_PREPROCESSOR, "video_processor_type": "SmolVLMVideoProcessor",
                                 "do_image_splitting": False}


def write_smolvlm_processor(path: str, vocab_size: int = 600, longest_edge: int | None = None) -> str:
    """A SmolVLM2 processor directory at `path` (SmolVLMProcessor, which needs num2words): the
    published image, video and processor configuration (with `longest_edge`, images resized to that
    edge instead of 1536), a BPE tokenizer trained here with its special tokens, and TRL's smolvlm
    training template (SmolVLM2 ships SmolVLM's)."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>",
              "eos_token": "<end_of_utterance>", "pad_token": "<|im_end|>"}
    preprocessor = _resized(SMOLVLM_PREPROCESSOR, longest_edge)
    return write_processor_dir(path, SMOLVLM_SPECIAL, vocab_size, config, preprocessor,
                               trl_template("smolvlm_training"), SMOLVLM_PROCESSOR, SMOLVLM_VIDEO)


LLAVA_NEXT_SPECIAL = ["<unk>", "<s>", "</s>", "<image>"]

# llava-hf/llava-v1.6-mistral-7b-hf's preprocessor_config.json and processor_config.json: anyres, an
# image resized to the best of its grid pinpoints, cut into 336-pixel patches plus the image resized
# whole; `pixel_values` [images, patches, 3, 336, 336], padded to the sample's most patches
LLAVA_NEXT_PREPROCESSOR: dict[str, Any] = {
    "crop_size": {"height": 336, "width": 336},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_grid_pinpoints": [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]],
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_processor_type": "LlavaNextImageProcessor",
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "processor_class": "LlavaNextProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 336},
}
LLAVA_NEXT_PROCESSOR = {"image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
                        "processor_class": "LlavaNextProcessor", "vision_feature_select_strategy": "default"}


def write_llava_next_processor(path: str, vocab_size: int = 600) -> str:
    """A LLaVA-NeXT processor directory at `path`: the published image processor and processor
    configuration, a BPE tokenizer trained here with its special tokens, and TRL's llava_next
    training template."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "pad_token": "<unk>"}
    return write_processor_dir(path, LLAVA_NEXT_SPECIAL, vocab_size, config, LLAVA_NEXT_PREPROCESSOR,
                               trl_template("llava_next_training"), LLAVA_NEXT_PROCESSOR)


LLAVA_ONEVISION_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>", "<video>"]

# llava-hf/llava-onevision-qwen2-0.5b-ov-hf's preprocessor_config.json (its 36 grid pinpoints, from
# 384 x 384 to 2304 x 2304) and processor_config.json: a conversation's one image is cut into the
# 384-pixel patches of its best pinpoint plus the image resized whole; each of several images is
# resized whole only
LLAVA_ONEVISION_PREPROCESSOR: dict[str, Any] = {
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_pad": True,
    "do_rescale": True,
    "do_resize": True,
    "image_grid_pinpoints": [[384 * h, 384 * w] for h in range(1, 7) for w in range(1, 7)],
    "image_mean": [0.5, 0.5, 0.5],
    "image_processor_type": "LlavaOnevisionImageProcessor",
    "image_std": [0.5, 0.5, 0.5],
    "processor_class": "LlavaOnevisionProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 384, "width": 384},
}
LLAVA_ONEVISION_PROCESSOR = {"image_token": "<image>", "num_image_tokens": 729,
                             "processor_class": "LlavaOnevisionProcessor", "video_token": "<video>",
                             "vision_aspect_ratio": "anyres_max_9", "vision_feature_select_strategy": "full"}
# its chat template (ChatML; images, then videos, then text, in each turn), with {% generation %} marks
LLAVA_ONEVISION_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + ' ' }}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'video') %}{{ '<video>' }}{% endfor %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endgeneration %}{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ '\\n' + content['text'] }}"
    "{% endfor %}{{ '<|im_end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_llava_onevision_processor(path: str, vocab_size: int = 600) -> str:
    """A LLaVA-OneVision processor directory at `path`: the published image processor and processor
    configuration, a BPE tokenizer trained here with its special tokens, and its chat template with
    generation marks."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    return write_processor_dir(path, LLAVA_ONEVISION_SPECIAL, vocab_size, config, LLAVA_ONEVISION_PREPROCESSOR,
                               LLAVA_ONEVISION_TEMPLATE, LLAVA_ONEVISION_PROCESSOR)


INTERNVL_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]

# OpenGVLab/InternVL3-1B-hf's image processor (GotOcr2: 448-pixel tiles of the canvas of closest
# aspect, 1 to 12 of them, and a thumbnail) and processor (256 tokens a tile, between <img> and </img>)
INTERNVL_PREPROCESSOR: dict[str, Any] = {
    "crop_to_patches": False,  # (the processor's call turns it on)
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_processor_type": "GotOcr2ImageProcessor",
    "image_std": [0.229, 0.224, 0.225],
    "max_patches": 12,
    "min_patches": 1,
    "processor_class": "InternVLProcessor",
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"height": 448, "width": 448},
}
INTERNVL_PROCESSOR = {"image_seq_length": 256, "processor_class": "InternVLProcessor"}
INTERNVL_VIDEO: dict[str, Any] = {"video_processor_type": "InternVLVideoProcessor",
                                  "processor_class": "InternVLProcessor", "size": {"height": 448, "width": 448},
                                  "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
# ChatML, an image part as <IMG_CONTEXT> on its own line (the processor expands it), with generation marks
INTERNVL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{% for content in message['content'] %}"
    "{% if content['type'] == 'text' %}{{ content['text'] }}{% endif %}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% endgeneration %}{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def write_internvl_processor(path: str, vocab_size: int = 600) -> str:
    """An InternVL processor directory at `path`: the published image, video and processor
    configuration, a BPE tokenizer trained here with its special tokens (named as the processor
    reads them), and a ChatML template with generation marks."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
              "extra_special_tokens": {"start_image_token": "<img>", "end_image_token": "</img>",
                                       "context_image_token": "<IMG_CONTEXT>", "video_token": "<video>"}}
    return write_processor_dir(path, INTERNVL_SPECIAL, vocab_size, config, INTERNVL_PREPROCESSOR, INTERNVL_TEMPLATE,
                               INTERNVL_PROCESSOR, INTERNVL_VIDEO)
