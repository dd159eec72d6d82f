"""A Hugging Face processor directory (`sources.<name>.processor`) as the coordinator sees it: read
from its JSON files only, never with transformers (coordinator hosts need neither transformers nor
torch). Workers load the processor itself (worker/processor.py).

What is read here: which processor and image processor classes the directory names, whether the
family's position ids are the three-row multimodal RoPE of the Qwen-VL models, and a hash of the
files that decide a sample (tokenizer, image and video processor configurations, chat template, the
model configuration's video timing): a host whose copy differs would make another stream, so it
does not serve, as with a transform.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import orjson

# processors whose models take three-row (temporal, height, width) RoPE position ids, computed as
# msd_common/mrope.py does; their image processors' merge_size merges patches into tokens
MROPE_PROCESSORS = frozenset({"Qwen2VLProcessor", "Qwen2_5_VLProcessor", "Qwen3VLProcessor", "Qwen3VLMoeProcessor"})

# the files whose bytes decide a sample (those present are hashed, in this order)
DECIDING_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                  "preprocessor_config.json", "processor_config.json", "chat_template.jinja", "chat_template.json",
                  "video_preprocessor_config.json")
DECIDING_FILES_0_4 = DECIDING_FILES[:-1]
# what the model's config.json decides of a sample: Qwen2.5-VL's video positions are spaced by
# vision_config.tokens_per_second. Only these keys are hashed: the rest of config.json (dtype,
# layer sizes) makes no other sample, and a host whose copy differs there serves.
DECIDING_CONFIG_KEYS = (("vision_config", "tokens_per_second"),)


class ProcessorDirError(ValueError):
    """The directory is not a usable processor directory; the message names the file and what is wrong."""


@dataclass(frozen=True)
class ProcessorInfo:
    path: str
    processor_class: str
    image_processor_type: str
    rope: str  # "mrope" (three rows, Qwen-VL) or "plain"
    merge_size: int  # patches merged per token side (mrope families), else 1
    digest: str  # of DECIDING_FILES

    def to_wire(self) -> dict:
        return {"processor_class": self.processor_class, "rope": self.rope, "merge_size": self.merge_size}


def _json(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            value = orjson.loads(f.read())
    except orjson.JSONDecodeError as e:
        raise ProcessorDirError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise ProcessorDirError(f"{path}: expected a JSON object")
    return value


def read_processor_dir(path: str) -> ProcessorInfo:
    """The processor directory at `path`, checked: a tokenizer.json, an image processor
    configuration naming its processor class, and a chat template. Raises ProcessorDirError."""
    if not os.path.isdir(path):
        raise ProcessorDirError(f"{path}: no such directory")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        raise ProcessorDirError(f"{path}: no tokenizer.json (a fast tokenizer is needed for the assistant mask)")
    image_config: dict = {}
    processor_config: dict = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            raw = _json(file)
            if name == "processor_config.json":
                processor_config = raw
                image_config = raw.get("image_processor", {}) if isinstance(raw.get("image_processor"), dict) else {}
            else:
                image_config = image_config or raw
                processor_config = processor_config or raw
    if not image_config:
        raise ProcessorDirError(f"{path}: no preprocessor_config.json (the image processor's configuration)")
    processor_class = processor_config.get("processor_class") or image_config.get("processor_class")
    if not isinstance(processor_class, str) or not processor_class:
        raise ProcessorDirError(f"{path}/preprocessor_config.json: no 'processor_class' (which processor the "
                                "directory is for)")
    image_type = image_config.get("image_processor_type", "")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("chat_template.jinja", "chat_template.json")):
        tokenizer_config = os.path.join(path, "tokenizer_config.json")
        if not (os.path.isfile(tokenizer_config) and _json(tokenizer_config).get("chat_template")):
            raise ProcessorDirError(f"{path}: no chat template (chat_template.jinja, chat_template.json, or "
                                    "chat_template in tokenizer_config.json)")
    rope = "mrope" if processor_class in MROPE_PROCESSORS else "plain"
    merge = image_config.get("merge_size", 2) if rope == "mrope" else 1
    if type(merge) is not int or merge < 1:
        raise ProcessorDirError(f"{path}/preprocessor_config.json: merge_size {merge!r} is not a positive integer")
    return ProcessorInfo(path, processor_class, str(image_type), rope, merge, processor_digest(path))


def processor_digest(path: str, as_of_0_4: bool = False) -> str:
    """Hash of what in a processor directory decides a sample: its DECIDING_FILES, and the
    DECIDING_CONFIG_KEYS of its config.json. as_of_0_4: as 0.4.0 hashed it, without the video
    processor's configuration and config.json (its jobs' digests, which their checkpoints carry)."""
    h = hashlib.sha256()
    for name in DECIDING_FILES_0_4 if as_of_0_4 else DECIDING_FILES:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            h.update(name.encode() + b"\0")
            with open(file, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
    config = os.path.join(path, "config.json")
    if os.path.isfile(config) and not as_of_0_4:
        model = _json(config)
        for keys in DECIDING_CONFIG_KEYS:
            value: object = model
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            if value is not None:
                h.update(".".join(("config.json", *keys)).encode() + b"\0" + orjson.dumps(value))
    return h.hexdigest()[:16]
