"""What a worker gets of a job at welcome: one SourceSpec per source (how to read its records and
make its samples) and the seed, in typed form. Part of the job spec (msd_common/spec.py builds
it with JobConfig.worker_job(), and re-exports it); a module of its own so that a worker, which
only reads it, does not import the job file's parser (a few MB in every worker process).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from .errors import ProtocolError
from .formats.limits import (DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_PIXELS, DEFAULT_MAX_RECORD_BYTES,
                             DEFAULT_MAX_SAMPLE_S, DEFAULT_PATCH_SIZE)
from .formats.records import FORMATS, is_memory_mapped


@dataclass(frozen=True)
class SourceSpec:
    """One source as a worker reads it (the coordinator sends it in `welcome`): its records (format,
    files, keys, limits, storage, where indexes and copies go) and how a record becomes a sample
    (tokenizer, images, the user's transform or chat template). Built from a SourceConfig by
    JobConfig.worker_job(); decoded from the wire by `from_wire`, which checks every field."""

    name: str
    index: int = 0
    format: str = "jsonl"
    files: tuple[str, ...] = ()
    text_key: str | None = None  # None: the format's default ("text"; WebDataset: the caption key)
    tokens_key: str | None = None
    tokenizer: str = "byte"
    eod_id: int | None = None
    image_token_id: int | None = None
    max_pixels: int = DEFAULT_MAX_PIXELS
    patch_size: int = DEFAULT_PATCH_SIZE
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    cache_dir: str | None = None
    cache_bytes: int | None = None
    copies: str = "plain"
    storage: dict[str, Any] | None = None
    seed: int = 0
    transform: str | None = None
    transform_args: dict[str, Any] | None = None
    transform_hash: str | None = None
    chat: dict[str, Any] | None = None
    processor: str | None = None  # a Hugging Face processor directory (worker/processor.py)
    image_backend: str = "pil"
    processor_hash: str | None = None
    image_pass: str = "delivery"  # when a processor's image pass runs (worker/image_plan.py)
    video_fps: float | None = None  # videos: frames sampled per second (None: the video processor's default)
    max_video_s: float | None = None  # videos: longer ones skip their record
    max_sample_s: float = DEFAULT_MAX_SAMPLE_S  # one record's sample taking longer is poison (host agent)

    @property
    def whole_records(self) -> bool:
        """Every field of a record is read: a transform or a chat template makes the sample."""
        return bool(self.transform or self.chat)

    @property
    def memory_mapped(self) -> bool:
        """Tokens read straight from local memory maps, lengths from the index (the coordinator
        prepares such a source itself), without opening it."""
        return is_memory_mapped(self.format, self.files, bool(self.transform))

    def to_wire(self) -> dict[str, Any]:
        out = asdict(self)
        out["files"] = list(self.files)
        return out

    @classmethod
    def from_wire(cls, raw: Any, where: str = "source") -> "SourceSpec":
        """A source spec from its wire (or plain dict) form; raises ProtocolError naming the field
        that is missing, unknown or of the wrong type."""
        if not isinstance(raw, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(raw).__name__}")
        unknown = set(raw) - _SOURCE_SPEC_TYPES.keys()
        if unknown:
            raise ProtocolError(f"{where}: unknown field(s) {', '.join(sorted(map(str, unknown)))}")
        if "name" not in raw:
            raise ProtocolError(f"{where}: no 'name'")
        values = {}
        for key, value in raw.items():
            kinds = _SOURCE_SPEC_TYPES[key]
            if key == "files" and isinstance(value, list):
                value = tuple(value)
            if not isinstance(value, kinds) or isinstance(value, bool) and bool not in kinds or \
                    key == "files" and not all(isinstance(f, str) for f in value):
                raise ProtocolError(f"{where}.{key}: {type(value).__name__} {value!r:.80} is not a valid value")
            values[key] = value
        if values.get("format", "jsonl") not in FORMATS:
            raise ProtocolError(f"{where}.format: {values['format']!r} is not one of {', '.join(FORMATS)}")
        return cls(**values)


_NONE = type(None)
_SOURCE_SPEC_TYPES: dict[str, tuple[type, ...]] = {
    "name": (str,), "index": (int,), "format": (str,), "files": (tuple,), "text_key": (str, _NONE),
    "tokens_key": (str, _NONE), "tokenizer": (str,), "eod_id": (int, _NONE), "image_token_id": (int, _NONE),
    "max_pixels": (int,), "patch_size": (int,), "max_record_bytes": (int,), "max_image_pixels": (int,),
    "cache_dir": (str, _NONE), "cache_bytes": (int, _NONE), "copies": (str,), "storage": (dict, _NONE),
    "seed": (int,), "transform": (str, _NONE), "transform_args": (dict, _NONE), "transform_hash": (str, _NONE),
    "chat": (dict, _NONE), "processor": (str, _NONE), "image_backend": (str,), "processor_hash": (str, _NONE),
    "image_pass": (str,), "max_sample_s": (float, int), "video_fps": (float, int, _NONE),
    "max_video_s": (float, int, _NONE),
}


@dataclass(frozen=True)
class WorkerJob:
    """What a worker gets of the job at welcome: the seed and every source's spec, in source order."""

    seed: int
    sources: tuple[SourceSpec, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"seed": self.seed, "sources": [s.to_wire() for s in self.sources]}

    @classmethod
    def from_wire(cls, raw: Any) -> "WorkerJob":
        """Raises ProtocolError naming the first bad field."""
        if not isinstance(raw, dict) or not isinstance(raw.get("sources"), list) or type(raw.get("seed")) is not int:
            raise ProtocolError("job: expected {seed: int, sources: [...]}")
        sources = tuple(SourceSpec.from_wire(s, f"job.sources[{i}]") for i, s in enumerate(raw["sources"]))
        if [s.index for s in sources] != list(range(len(sources))):
            raise ProtocolError("job.sources: indexes are not 0, 1, 2, ... in order")
        return cls(raw["seed"], sources)
