"""Job file (YAML) -> typed, validated JobConfig.

Strict: an unknown key, a wrong type, a negative/NaN/all-zero weight, a weight for an unknown
source, a path that matches no file, an unknown format or tokenizer are all reported, every
problem at once, each naming its key (`ConfigError.problems`). File *contents* (truncated
Megatron pairs) are checked when the sources are opened (`coordinator.sources`).
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson

from .doc_keys import MAX_SOURCES
from .errors import MsdError
from .formats.errors import SourceFormatError
from .formats.limits import (DEFAULT_CAPTION_KEY, DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_PIXELS,
                             DEFAULT_MAX_RECORD_BYTES,
                             DEFAULT_MAX_SAMPLE_S, DEFAULT_PATCH_SIZE)
from .formats.records import FORMATS
from .formats.storage import SECRET_KEYS, is_url, store_for
from .job_keys import EVAL, METHODS, SRC, allowed, required
from .topology import AXES, DEFAULT_ORDER, DELIVERY, Topology
from .worker_job import SourceSpec, WorkerJob
from .usercode import TRAIN_ON, ChatError, TransformImportError, code_hash, compile_template, find_template

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")
SUFFIXES = {"jsonl": JSONL_SUFFIXES, "parquet": (".parquet",), "arrow": (".arrow",), "webdataset": (".tar",)}
ALLOCATIONS = ("adaptive", "fixed")
INDEX_ON = ("coordinator", "workers")  # runtime.index_on: who builds missing shard indexes at start-up
COPIES = ("plain", "seekable")  # runtime.copies: how compressed JSONL shards are kept for random access
WHOLE_OBJECT_FORMATS = ("jsonl", "megatron")  # storage.whole_objects: read from a local copy of each object
INDEX_SUFFIXES = (".msdidx.npy", ".msdidx.json")  # indexes stored beside remote shards (storage.share_indexes)
DEFAULT_CACHE_BYTES = 64 << 30
DEFAULT_AHEAD_BYTES = 4 << 30  # per rank: a few steps of a few hundred megapixel-sized images
PROCESSOR_PREPARE_BATCH = 8  # runtime.prepare_batch's default in a job with a processor source
MAX_SHUFFLE_BLOCK = 1 << 16


class ConfigError(MsdError):
    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"{source}: {len(problems)} problem(s):\n" + "\n".join(f"  - {p}" for p in problems))


@dataclass(frozen=True)
class SourceConfig:
    name: str
    index: int
    format: str
    files: tuple[str, ...]  # shard paths, or Megatron prefixes; sorted, absolute
    text_key: str = "text"  # JSONL key / Parquet column of the text; WebDataset: caption JSON key
    tokenizer: str = "byte"  # "byte" or an absolute path to a HF tokenizer.json
    eod_id: int | None = None
    long_docs: str = "split"  # documents longer than seq_len: "split" into pieces, or "truncate"
    epochs: int | None = None  # passes over the source; None: repeat forever (new order each epoch)
    on_exhausted: str = "renormalize"  # when a finite source runs out: "renormalize" or "stop"
    tokens_key: str | None = None  # Parquet: a list-of-int column of token ids, used as stored
    image_token_id: int | None = None  # WebDataset: the placeholder id, one per image patch
    max_pixels: int = DEFAULT_MAX_PIXELS  # WebDataset: images are scaled down to at most this many pixels
    patch_size: int = DEFAULT_PATCH_SIZE  # WebDataset: square patches of patch_size x patch_size pixels
    # Poison limits, checked before a record is decoded; a record over one is skipped with the reason.
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # a record's stored bytes (line, row value, tar entries, document)
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # WebDataset: pixels an image's header declares
    # Object storage: the file system's options for URL paths (endpoint, region, profile; never
    # secrets) and ours (max_retries, share_indexes, whole_objects); see msd_common/formats/storage.py
    storage: dict[str, Any] | None = None
    # Records shuffled in runs of this many consecutive ones (cursor.BlockPermutation): a run is
    # one request to object storage; 1 shuffles every record on its own
    shuffle_block: int = 1
    # A transform of the user's own ("package.module:function", worker/transforms.py), its keyword
    # arguments, and a hash of its module's code (the job's identity: a changed transform is noticed)
    transform: str | None = None
    transform_args: dict[str, Any] | None = None
    transform_hash: str | None = None
    max_transform_errors: int = 100  # consecutive transform errors on the source that stop the job
    # chat data: {messages_key, train_on, tools_key}, rendered with the tokenizer's chat template (worker/chat.py)
    chat: dict[str, Any] | None = None
    # "concat": documents cut where a row or a step ends (pretraining); "whole": never cut (rows padded)
    packing: str = "concat"
    # a Hugging Face processor directory (conversations with images, worker/processor.py), the image
    # processor's backend, and a hash of the directory's deciding files (the job's identity)
    processor: str | None = None
    image_backend: str = "pil"
    processor_hash: str | None = None
    # when a processor's image pass runs: "delivery" (planned from image sizes, worker/image_plan.py,
    # for the families that can be) or "prepare" (whole, at prepare time); the samples are the same
    image_pass: str = "delivery"
    # videos (worker/video_plan.py): frames sampled per second (None: as the video processor does
    # by default), and the seconds past which a video skips its record (None: no limit but the
    # processor's frame cap)
    video_fps: float | None = None
    max_video_s: float | None = None
    # one record's sample (read, transform, processor, an image pass at delivery) taking longer than
    # this is poison: its worker process is stopped and the record quarantined (not part of the stream)
    max_sample_s: float = DEFAULT_MAX_SAMPLE_S

    @property
    def has_images(self) -> bool:
        """Images as the built-in patches (uint8, one placeholder per patch)."""
        return ((self.format == "webdataset" and self.processor is None)
                or (self.transform is not None and self.image_token_id is not None))

    @property
    def has_encoder_cost(self) -> bool:
        """Samples whose images cost the vision encoder: their patches are reported and planned."""
        return self.has_images or self.processor is not None

    @property
    def whole(self) -> bool:
        return self.packing == "whole"


@dataclass(frozen=True)
class BatchConfig:
    seq_len: int
    micro_batch_size: int
    global_batch_size: int  # sequences per step
    pad_id: int = 257


@dataclass(frozen=True)
class CostConfig:
    """cost of a piece = quadratic*len^2 + linear*len + patch_quadratic*patches^2 + patch_linear*patches"""

    quadratic: float = 1.0
    linear: float = 0.0
    patch_quadratic: float = 0.0
    patch_linear: float = 0.0

    def of(self, length: int, patches: int = 0) -> float:
        return (self.quadratic * length * length + self.linear * length
                + self.patch_quadratic * patches * patches + self.patch_linear * patches)


@dataclass(frozen=True)
class Stage:
    """One curriculum stage: it covers steps [previous stage's until_step, until_step)."""

    weights: tuple[float, ...]  # per source index, normalised to sum 1
    until_step: int | None = None  # None: the last stage, open-ended
    ramp_steps: int = 0  # weights move linearly from the previous stage's over this many steps
    seq_len: int | None = None  # None: batch.seq_len


@dataclass(frozen=True)
class EvalSetConfig:
    """An evaluation set (`eval:` in the job file): records held out of training sources by a
    keyed hash (`holdout`: source index -> share of its records, a float, or a count, an int),
    and every record of sources named for it (`sources`), at most `max_records` of them (a fixed
    sample). Its rows are `seq_len` long (default: batch.seq_len)."""

    name: str
    index: int
    holdout: tuple[tuple[int, float | int], ...] = ()
    sources: tuple[int, ...] = ()
    max_records: int | None = None
    seq_len: int | None = None
    prepare_ahead: bool = False


@dataclass(frozen=True)
class RuntimeConfig:
    lookahead_steps: int = 4  # steps planned ahead of the slowest rank's consumed step
    heartbeat_s: float = 1.0
    prepare_batch: int = 64  # records per prepare task
    status_every_s: float = 30.0  # status line in the log (and status.json in --state-dir)
    # how prepare work is given to workers: "adaptive" (any worker, by measured cost and
    # backlog) or "fixed" (each worker serves one source, workers split equally: the per-source
    # loader design, kept for comparison)
    allocation: str = "adaptive"
    shrink_after_s: float = 10.0  # `--procs auto` hosts lose a process after workers idled this long
    # memory for the recent event bursts and their instructions, written to the state dir when the
    # coordinator fails (coordinator/stimulus.py); 0 keeps none
    stimulus_log_mb: float = 4.0
    # where indexes of JSONL and WebDataset shards and decompressed copies of compressed JSONL go
    # (on every host that reads them); None: beside the data where writable, else
    # $MSD_CACHE_DIR or ~/.cache/megascale-data
    cache_dir: str | None = None
    # bound of the local copies of remote compressed shards (least recently used evicted first)
    cache_bytes: int = DEFAULT_CACHE_BYTES
    # who builds the indexes (and copies) of JSONL and WebDataset shards this host has none of,
    # at start-up: "coordinator" (a pool of this host's cores, before it listens) or "workers"
    # (the worker processes of every host, sharing the shards; they report the record counts)
    index_on: str = "coordinator"
    # how a compressed JSONL shard (local, or copied from object storage) is kept for random
    # access: "plain" (decompressed, 4.4x the zstd bytes; a record is one pread) or "seekable"
    # (Zstandard seekable format, 1.4x; a record decompresses its 64 KiB frames, ~90 us; writing
    # it costs ~3 s more CPU per GB of text)
    copies: str = "plain"
    # after a fatal error the coordinator keeps its address this long (or until SIGTERM), answering
    # every hello with job_failed and the reason, so that ranks arriving late learn why
    failed_linger_s: float = 600.0
    # per rank, the bytes of arrays beside the tokens (image frames, a processor's arrays) delivered
    # ahead of the slowest rank: past it no further step is planned (the next step always is)
    ahead_bytes: int = DEFAULT_AHEAD_BYTES


ADAPT_POLICIES = ("odm", "ado", "loss_share")  # mixture.adapt.policy's built-ins (coordinator/adapt.py)


@dataclass(frozen=True)
class AdaptConfig:
    """mixture.adapt: the policy that maps the trainers' per-source losses to weights, and its limits."""

    policy: str
    every_steps: int
    min_weight: float = 0.0
    max_step_change: float = 1.0  # the most one decision moves a source's weight
    warmup_steps: int = 0
    sources: tuple[str, ...] = ()  # the sources adapted (empty: all); the others keep their weights
    policy_hash: str | None = None  # a user's policy: its module's code (part of the job's identity)


@dataclass(frozen=True)
class JobConfig:
    seed: int
    sources: tuple[SourceConfig, ...]
    batch: BatchConfig
    dp: int
    topology: Topology
    stages: tuple[Stage, ...]
    cost: CostConfig
    curve_keys: str | None = None  # security.curve: a key directory (msd keys generate); None: plain
    balance_method: str = "greedy"
    token_slack: float = 0.0  # a rank may hold up to (1 + slack) x its token capacity
    calibrate: bool = False  # fit the cost model to the trainers' compute times as the job runs
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    path: str = "<job>"
    eval_sets: tuple[EvalSetConfig, ...] = ()
    adapt: AdaptConfig | None = None  # mixture.adapt

    def eval_set(self, name: str) -> EvalSetConfig:
        for e in self.eval_sets:
            if e.name == name:
                return e
        raise KeyError(f"no eval set {name!r} (the job's: {', '.join(e.name for e in self.eval_sets) or 'none'})")

    @property
    def weights(self) -> dict[str, float]:
        """The first stage's weights by source name (the whole mixture of a single-stage job)."""
        return {s.name: self.stages[0].weights[s.index] for s in self.sources}

    def stage_at(self, step: int) -> tuple[int, Stage]:
        """(index, stage) of the stage that plans `step`."""
        for i, stage in enumerate(self.stages):
            if stage.until_step is None or step < stage.until_step:
                return i, stage
        return len(self.stages) - 1, self.stages[-1]

    def weights_at(self, step: int) -> list[float]:
        """Source weights for `step`, with the linear ramp from the previous stage applied."""
        i, stage = self.stage_at(step)
        if i == 0 or stage.ramp_steps == 0:
            return list(stage.weights)
        start = self.stages[i - 1].until_step
        f = min(1.0, (step - start + 1) / stage.ramp_steps)
        prev = self.stages[i - 1].weights
        return [(1 - f) * a + f * b for a, b in zip(prev, stage.weights)]

    def seq_len_at(self, step: int) -> int:
        return self.stage_at(step)[1].seq_len or self.batch.seq_len

    def step_tokens_at(self, step: int) -> int:
        return self.batch.global_batch_size * self.seq_len_at(step)

    def row_capacity_at(self, step: int) -> int:
        """Tokens per packed sequence at `step`, padding included (seq_len, plus the token slack)."""
        return int(self.seq_len_at(step) * (1.0 + self.token_slack))

    @property
    def micro_batches_per_rank(self) -> int:
        return self.batch.global_batch_size // (self.dp * self.batch.micro_batch_size)

    @property
    def step_tokens(self) -> int:
        return self.batch.global_batch_size * self.batch.seq_len

    @property
    def patch_bytes(self) -> int:
        """Bytes of one image patch (every image source has the same patch_size); 0 without images."""
        return next((s.patch_size * s.patch_size * 3 for s in self.sources if s.has_images), 0)

    @property
    def rope(self) -> str:
        """"mrope" when the job's processor sources are of a Qwen-VL model (position ids of three
        rows in every batch), else "plain"."""
        from .processor_dir import read_processor_dir

        ropes = {read_processor_dir(s.processor).rope for s in self.sources if s.processor is not None}
        return "mrope" if "mrope" in ropes else "plain"

    def source(self, name: str) -> SourceConfig:
        return next(s for s in self.sources if s.name == name)

    def worker_job(self) -> "WorkerJob":
        """What workers need to read records and make samples: each source's definition and where
        to keep indexes and copies, nothing about the plan."""
        return WorkerJob(self.seed, tuple(
            SourceSpec(name=s.name, index=s.index, format=s.format, files=s.files, text_key=s.text_key,
                       tokens_key=s.tokens_key, tokenizer=s.tokenizer, eod_id=s.eod_id, image_token_id=s.image_token_id,
                       max_pixels=s.max_pixels, patch_size=s.patch_size, max_record_bytes=s.max_record_bytes,
                       max_image_pixels=s.max_image_pixels, cache_dir=self.runtime.cache_dir,
                       cache_bytes=self.runtime.cache_bytes, copies=self.runtime.copies, storage=s.storage,
                       seed=self.seed, transform=s.transform, transform_args=s.transform_args,
                       transform_hash=s.transform_hash, chat=s.chat, processor=s.processor,
                       image_backend=s.image_backend, processor_hash=s.processor_hash, image_pass=s.image_pass,
                       video_fps=s.video_fps, max_video_s=s.max_video_s,
                       max_sample_s=s.max_sample_s)
            for s in self.sources))

    def stream_definition(self, where: bool = False, processors_as_of_0_4: bool = False) -> dict[str, Any]:
        """Everything that defines the global stream of batches (which documents, which tokens,
        in which step), as plain JSON: not the topology (the same global batches can be laid
        out over any number of ranks) and not runtime knobs. The data by its identity, not by
        where it lies: each source's files relative to their common directory (or bucket prefix),
        a tokenizer by its content, so that the same job over the same data moved elsewhere (a
        new cluster, a restored bucket) is the same job. where True: as 0.3.0 defined it, with the
        absolute paths (digest_before_0_4). processors_as_of_0_4: each processor directory hashed as
        0.4.0 hashed it (earlier_digests)."""
        sources = self.sources
        if processors_as_of_0_4:
            from .processor_dir import processor_digest

            sources = tuple(replace(s, processor_hash=processor_digest(s.processor, as_of_0_4=True))
                            if s.processor is not None else s for s in sources)
        return orjson.loads(orjson.dumps({
            "seed": self.seed,
            "sources": [_stream_fields(s, where) for s in sources],
            "batch": asdict(self.batch),
            "stages": [asdict(st) for st in self.stages],
            "cost": asdict(self.cost),
            "balance": {"method": self.balance_method, "token_slack": self.token_slack,
                        **({"calibrate": True} if self.calibrate else {})},
            # eval sets change which records training holds: part of the stream (absent when none,
            # so a job without them keeps its digest)
            **({"eval": [asdict(e) for e in self.eval_sets]} if self.eval_sets else {}),
            **({"adapt": asdict(self.adapt)} if self.adapt else {}),  # (absent without: digests kept)
        }))

    def digest(self) -> str:
        """Fingerprint of the stream definition: the job's identity (the same wherever its data lies)."""
        return hashlib.sha256(orjson.dumps(self.stream_definition(), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def digest_before_0_4(self) -> str:
        """The digest 0.3.0 gave this job (with its data's absolute paths): its state dirs' journals
        and its trainers' checkpoints carry it, and are taken as this job's."""
        return hashlib.sha256(orjson.dumps(self.stream_definition(where=True),
                                           option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]

    def earlier_digests(self) -> list[str]:
        """The digests earlier versions gave this job, whose state dirs' journals and trainers'
        checkpoints are taken as this job's: 0.3.0's (digest_before_0_4), and 0.4.0's where a
        processor directory hashes otherwise now (it did not cover the video configuration)."""
        earlier = [self.digest_before_0_4()]
        if any(s.processor is not None for s in self.sources):
            as_of_0_4 = hashlib.sha256(orjson.dumps(self.stream_definition(processors_as_of_0_4=True),
                                                    option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
            if as_of_0_4 != self.digest():
                earlier.append(as_of_0_4)
        return earlier


def _stream_fields(source: SourceConfig, where: bool = False) -> dict[str, Any]:
    """A source's part of the stream definition. The poison limits and shuffle_block appear only
    when they differ from their defaults, so a job written before they existed keeps its digest
    (and state dir)."""
    out = asdict(source)
    if not where:
        out["files"] = relative_files(source.files)
        if source.tokenizer != "byte":
            out["tokenizer"] = content_digest(source.tokenizer)
    del out["storage"]  # how the shards are reached, not which tokens they hold
    del out["processor"]  # where the processor directory is: its content is processor_hash
    del out["image_pass"]  # when the image pass runs, not what it makes
    del out["max_sample_s"]  # how long a sample may take: a limit of the run, not what it makes
    if out["chat"] and "template" in out["chat"]:  # where the template file is: its content is template_hash
        out["chat"] = {k: v for k, v in out["chat"].items() if k != "template"}
    for key, default in (("max_record_bytes", DEFAULT_MAX_RECORD_BYTES), ("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS),
                         ("shuffle_block", 1), ("transform", None), ("transform_args", None), ("transform_hash", None),
                         ("max_transform_errors", 100), ("chat", None), ("packing", "concat"),
                         ("image_backend", "pil"), ("processor_hash", None), ("video_fps", None),
                         ("max_video_s", None)):
        if out[key] == default:
            del out[key]
    return out


def relative_files(files: tuple[str, ...] | list[str]) -> list[str]:
    """The files relative to their longest common directory (a bucket's prefix for URLs): what
    stays the same when the data moves as a whole."""
    parts = [f.split("/") for f in files]
    if not parts:
        return []
    common = 0
    shortest = min(len(p) for p in parts) - 1  # the last component is a file's own name: always kept
    while common < shortest and all(p[common] == parts[0][common] for p in parts):
        common += 1
    return ["/".join(p[common:]) for p in parts]


_CONTENT: dict[tuple, str] = {}


def content_digest(path: str) -> str:
    """A file's content hash, or a directory's (its files' names and contents): a tokenizer by
    what it is, not where it lies. Cached by path, size and modification time."""
    paths = sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names) if os.path.isdir(path) \
        else [path]
    key = tuple((p, os.path.getsize(p), os.path.getmtime(p)) for p in paths)
    if key not in _CONTENT:
        h = hashlib.sha256()
        for p in paths:
            h.update(os.path.relpath(p, path).encode() + b"\0" if p != path else b"")
            with open(p, "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        _CONTENT[key] = h.hexdigest()[:16]
    return _CONTENT[key]


def config_diff(old: Any, new: Any, path: str = "") -> list[str]:
    """`key: old -> new` for every leaf that differs between two JSON-like values."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in sorted(set(old) | set(new), key=str):
            out += config_diff(old.get(k, "<absent>"), new.get(k, "<absent>"), f"{path}.{k}" if path else str(k))
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in config_diff(a, b, f"{path}[{i}]")]
    return [] if old == new else [f"{path}: {old!r} -> {new!r}"]


class _Checker:
    """Collects problems instead of stopping at the first."""

    def __init__(self) -> None:
        self.problems: list[str] = []

    def bad(self, key: str, what: str) -> None:
        self.problems.append(f"{key}: {what}")

    def mapping(self, value: Any, key: str, allowed: set[str], required: set[str] = frozenset()) -> dict:
        if not isinstance(value, dict):
            self.bad(key, f"expected a mapping, got {type(value).__name__}")
            return {}
        for k in value:
            if k not in allowed:
                self.bad(f"{key}.{k}" if key else str(k), f"unknown key (allowed: {', '.join(sorted(allowed))})")
        for k in sorted(required - value.keys()):
            self.bad(f"{key}.{k}" if key else k, "required key missing")
        return value

    def integer(self, value: Any, key: str, minimum: int = 1) -> int | None:
        if type(value) is not int:
            self.bad(key, f"expected an integer, got {value!r}")
            return None
        if value < minimum:
            self.bad(key, f"must be >= {minimum}, got {value}")
            return None
        return value

    def number(self, value: Any, key: str) -> float | None:
        if type(value) not in (int, float) or math.isnan(value) or math.isinf(value):
            self.bad(key, f"expected a finite number, got {value!r}")
            return None
        if value < 0:
            self.bad(key, f"must not be negative, got {value}")
            return None
        return float(value)


def _expand(pattern: str, base: str, fmt: str, storage: dict[str, Any] | None = None) -> list[str]:
    """Sorted shard paths (Megatron: prefixes) a pattern matches: local files, or objects of a
    store when the pattern is a URL."""
    remote = is_url(pattern)
    if not remote:
        pattern = os.path.join(base, os.path.expanduser(pattern))
    find = store_for(pattern, storage).glob if remote else (
        lambda p: sorted(f for f in glob.glob(p) if os.path.isfile(f)))
    if fmt == "megatron":
        prefix_pattern = pattern[:-4] if pattern.endswith((".bin", ".idx")) else pattern
        return sorted({p[:-4] for p in find(prefix_pattern + ".idx")})
    return [p for p in find(pattern) if not p.endswith(INDEX_SUFFIXES)]


def _storage(c: _Checker, raw: Any, key: str) -> dict[str, Any] | None:
    """A source's storage block: file-system options, checked for secrets, and ours."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        c.bad(key, f"expected a mapping of storage options, got {raw!r}")
        return None
    def secrets(value: Any, where: str) -> list[str]:
        if isinstance(value, dict):
            return [f"{where}.{k}" for k in value if str(k).lower() in SECRET_KEYS] + [
                hit for k, v in value.items() for hit in secrets(v, f"{where}.{k}")]
        return []
    for hit in secrets(raw, key):
        c.bad(hit, "secrets do not belong in the job file: give credentials through the store's environment "
                   "(AWS_ACCESS_KEY_ID, AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_* ...)")
    if "max_retries" in raw:
        c.integer(raw["max_retries"], f"{key}.max_retries", 0)
    for flag in ("share_indexes", "whole_objects"):
        if flag in raw and not isinstance(raw[flag], bool):
            c.bad(f"{key}.{flag}", f"expected true or false, got {raw[flag]!r}")
    return dict(raw)


LONG_DOCS = ("split", "truncate", "drop")
PACKING = ("concat", "whole")
CHAT_FORMATS = ("jsonl", "parquet", "arrow")
# a processor's conversations: records of these, or WebDataset samples (a JSON conversation whose
# image parts name the sample's image entries)
PROCESSOR_FORMATS = (*CHAT_FORMATS, "webdataset")
IMAGE_BACKENDS = ("pil", "torchvision")  # sources.<name>.image_backend: transformers' image processor backends
IMAGE_PASSES = ("delivery", "prepare")  # sources.<name>.image_pass: when a processor's image pass runs
ON_EXHAUSTED = ("renormalize", "stop")


def _choice(c: _Checker, value: Any, key: str, allowed: tuple[str, ...]) -> bool:
    if value not in allowed:
        c.bad(key, f"expected one of {', '.join(allowed)}, got {value!r}")
        return False
    return True


def _source(c: _Checker, name: Any, raw: Any, index: int, base: str, defaults: dict[str, Any]) -> SourceConfig | None:
    key = f"sources.{name}"
    if not isinstance(name, str) or not name:
        c.bad(key, "source names must be non-empty strings")
        return None
    raw = c.mapping(raw, key, allowed(SRC), required(SRC))
    storage = _storage(c, raw.get("storage"), f"{key}.storage")
    fmt = raw.get("format")
    ok = True
    if "format" in raw and fmt not in FORMATS:
        c.bad(f"{key}.format", f"unknown format {fmt!r} (expected one of: {', '.join(FORMATS)})")
        ok = False
    elif storage and storage.get("whole_objects") and fmt not in WHOLE_OBJECT_FORMATS:
        c.bad(f"{key}.storage.whole_objects", f"supported for {' and '.join(WHOLE_OBJECT_FORMATS)} sources, not "
                                              f"{fmt} (arrow files are always copied whole)")
    paths = raw.get("paths")
    if isinstance(paths, str):
        paths = [paths]
    files: list[str] = []
    if "paths" in raw:
        if not isinstance(paths, list) or not paths or not all(isinstance(p, str) for p in paths):
            c.bad(f"{key}.paths", "expected a non-empty list of path patterns")
            ok = False
        elif fmt in FORMATS:
            for p in paths:
                try:
                    matched = _expand(p, base, fmt, storage)
                except (SourceFormatError, OSError) as e:
                    c.bad(f"{key}.paths", f"{p!r}: cannot list the store ({e})")
                    ok = False
                    continue
                if not matched:
                    what = "no .idx file" if fmt == "megatron" else "no file"
                    c.bad(f"{key}.paths", f"{p!r} matches {what}")
                    ok = False
                files.extend(matched)
            for f in files if fmt in SUFFIXES else ():
                if not f.endswith(SUFFIXES[fmt]):
                    c.bad(f"{key}.paths", f"{f}: not one of {', '.join(SUFFIXES[fmt])}")
                    ok = False
    tokenizer = raw.get("tokenizer", "byte")
    if fmt == "megatron" and ("tokenizer" in raw or "text_key" in raw):
        c.bad(key, "megatron sources are pre-tokenized: tokenizer and text_key do not apply")
        ok = False
    if not isinstance(tokenizer, str):
        c.bad(f"{key}.tokenizer", f"expected 'byte' or a path to tokenizer.json, got {tokenizer!r}")
        ok = False
    elif tokenizer != "byte":
        tokenizer = os.path.join(base, os.path.expanduser(tokenizer))
        if not os.path.exists(tokenizer):
            c.bad(f"{key}.tokenizer", f"unknown tokenizer {raw['tokenizer']!r}: not 'byte' and no such file or "
                                      "directory")
            ok = False
        else:
            ok = _check_hf_tokenizer(c, key, tokenizer, raw.get("eod_id")) and ok
    text_key = raw.get("text_key", DEFAULT_CAPTION_KEY if fmt == "webdataset" else "text")
    if not isinstance(text_key, str) or not text_key:
        c.bad(f"{key}.text_key", "expected a non-empty string")
        ok = False
    tokens_key = raw.get("tokens_key")
    if tokens_key is not None and (fmt not in ("parquet", "arrow") or not isinstance(tokens_key, str)
                                   or not tokens_key):
        c.bad(f"{key}.tokens_key", "a non-empty column name, for parquet and arrow sources only")
        ok = False
    elif tokens_key is not None and ("tokenizer" in raw or "text_key" in raw):
        c.bad(key, "tokens_key names pre-tokenized ids: tokenizer and text_key do not apply")
        ok = False
    image_token_id = raw.get("image_token_id")
    max_pixels = raw.get("max_pixels", DEFAULT_MAX_PIXELS)
    patch_size = raw.get("patch_size", DEFAULT_PATCH_SIZE)
    user_code = _user_code(c, key, raw, fmt, tokenizer if ok else None, base)
    if user_code is None:
        ok = False
    builtin_images = fmt == "webdataset" and "processor" not in raw  # with a processor, the processor's images
    if builtin_images or ("transform" in raw and image_token_id is not None):
        if image_token_id is None:
            c.bad(f"{key}.image_token_id", "required for webdataset sources (the id of one patch placeholder)")
            ok = False
        elif c.integer(image_token_id, f"{key}.image_token_id", 0) is None:
            ok = False
        patch_size = c.integer(patch_size, f"{key}.patch_size", 1)
        max_pixels = c.integer(max_pixels, f"{key}.max_pixels", 1)
        if patch_size is None or max_pixels is None:
            ok = False
        elif max_pixels < patch_size * patch_size:
            c.bad(f"{key}.max_pixels", f"{max_pixels} is less than one patch ({patch_size}x{patch_size})")
            ok = False
    else:
        for k in ("image_token_id", "max_pixels", "patch_size"):
            if k in raw:
                c.bad(f"{key}.{k}", "applies to webdataset sources without a processor and sources with a "
                                    "transform only")
                ok = False
    eod_id = raw.get("eod_id")
    if eod_id is not None and c.integer(eod_id, f"{key}.eod_id", 0) is None:
        ok = False
    max_record_bytes = c.integer(raw.get("max_record_bytes", DEFAULT_MAX_RECORD_BYTES), f"{key}.max_record_bytes", 1)
    max_image_pixels = raw.get("max_image_pixels", DEFAULT_MAX_IMAGE_PIXELS)
    if fmt != "webdataset" and "max_image_pixels" in raw and "processor" not in raw:
        c.bad(f"{key}.max_image_pixels", "applies to webdataset sources and sources with a processor only")
        ok = False
    else:
        max_image_pixels = c.integer(max_image_pixels, f"{key}.max_image_pixels", 1)
    if max_record_bytes is None or max_image_pixels is None:
        ok = False
    processor = _processor(c, key, raw, fmt, base, user_code)
    if processor is None:
        ok = False
    elif processor:
        user_code = {**(user_code or {}), "chat": processor.pop("chat")}
    images_whole = bool(processor)  # an image conversation is never cut
    packing = raw.get("packing", "whole" if images_whole else "concat")
    ok = _choice(c, packing, f"{key}.packing", PACKING) and ok
    if images_whole and packing != "whole":
        c.bad(f"{key}.packing", "a source with a processor is packed whole: an image conversation is never cut")
        ok = False
    long_docs = raw.get("long_docs", "drop" if images_whole else
                        defaults.get("long_docs", "truncate" if packing == "whole" else "split"))
    ok = _choice(c, long_docs, f"{key}.long_docs", LONG_DOCS) and ok
    if packing == "whole" and long_docs == "split":
        c.bad(f"{key}.long_docs", "a whole-sample source is never cut: truncate or drop what is longer than seq_len")
        ok = False
    elif images_whole and long_docs != "drop":
        c.bad(f"{key}.long_docs", "a source with a processor drops what is longer than a row (its images would be "
                                  "cut from their tokens)")
        ok = False
    on_exhausted = raw.get("on_exhausted", defaults.get("on_exhausted", "renormalize"))
    ok = _choice(c, on_exhausted, f"{key}.on_exhausted", ON_EXHAUSTED) and ok
    epochs = raw.get("epochs")
    if epochs is not None and c.integer(epochs, f"{key}.epochs") is None:
        ok = False
    max_sample_s = c.number(raw.get("max_sample_s", DEFAULT_MAX_SAMPLE_S), f"{key}.max_sample_s")
    if max_sample_s is None:
        ok = False
    elif max_sample_s <= 0:
        c.bad(f"{key}.max_sample_s", f"must be > 0 seconds, got {max_sample_s}")
        ok = False
    shuffle_block = c.integer(raw.get("shuffle_block", 1), f"{key}.shuffle_block", 1)
    if shuffle_block is None:
        ok = False
    elif shuffle_block > MAX_SHUFFLE_BLOCK:
        c.bad(f"{key}.shuffle_block", f"{shuffle_block} records: at most {MAX_SHUFFLE_BLOCK} (a run is one prepare "
                                      "task and one request)")
        ok = False
    if not ok:
        return None
    return SourceConfig(name, index, fmt, tuple(files), text_key, tokenizer, eod_id, long_docs, epochs, on_exhausted,
                        tokens_key, image_token_id, max_pixels, patch_size, max_record_bytes, max_image_pixels,
                        storage, shuffle_block, **user_code, packing=packing, **(processor or {}),
                        max_sample_s=float(max_sample_s))


def _processor(c: _Checker, key: str, raw: dict, fmt: Any, base: str, user_code: dict | None) -> dict[str, Any] | None:
    """A source's `processor` directory (checked from its JSON files, hashed) and its chat block:
    {} without one, None on a problem (named)."""
    from .processor_dir import ProcessorDirError, read_processor_dir

    path = raw.get("processor")
    if path is None:
        for k in ("image_backend", "image_pass", "video_fps", "max_video_s"):
            if k in raw:
                c.bad(f"{key}.{k}", "applies to a source with a processor only")
                return None
        return {}
    ok = True
    if not isinstance(path, str) or not path:
        c.bad(f"{key}.processor", f"expected the path of a processor directory, got {path!r}")
        return None
    transform = "transform" in raw  # the user's code makes the sample with the processor (ctx.processor)
    if fmt not in PROCESSOR_FORMATS and not transform:
        c.bad(f"{key}.processor", f"for {', '.join(PROCESSOR_FORMATS)} sources (or any, with a transform), not {fmt}")
        ok = False
    for k in ("tokenizer", "eod_id"):
        if k in raw:
            c.bad(f"{key}.{k}", "does not go with processor (the processor's tokenizer and chat template make the "
                                "sample)")
            ok = False
    backend = raw.get("image_backend", "pil")
    ok = _choice(c, backend, f"{key}.image_backend", IMAGE_BACKENDS) and ok
    image_pass = raw.get("image_pass", "delivery")
    ok = _choice(c, image_pass, f"{key}.image_pass", IMAGE_PASSES) and ok
    video: dict[str, float | None] = {}
    for k in ("video_fps", "max_video_s"):
        value = raw.get(k)
        if value is not None:
            value = c.number(value, f"{key}.{k}")
            if value is None:
                ok = False
            elif value <= 0:
                c.bad(f"{key}.{k}", f"must be > 0, got {value:g}")
                ok = False
        video[k] = value
    chat = (user_code or {}).get("chat") or {"messages_key": "messages", "train_on": "assistant", "tools_key": "tools"}
    if chat.get("train_on") == "last":
        c.bad(f"{key}.chat.train_on", "a source with a processor trains on assistant or all (the processor's mask)")
        ok = False
    path = os.path.join(base, os.path.expanduser(path))
    try:
        info = read_processor_dir(path)
    except ProcessorDirError as e:
        c.bad(f"{key}.processor", str(e))
        return None
    if not ok:
        return None
    if transform:  # the transform's tokens and mask: no template of ours to check
        return {"processor": path, "image_backend": backend, "processor_hash": info.digest, "chat": None,
                "image_pass": image_pass, **video}
    try:
        template, origin = find_template(chat.get("template") or path)
    except (ChatError, OSError, ValueError) as e:
        c.bad(f"{key}.processor", str(e))
        return None
    if chat.get("train_on", "assistant") == "assistant" and "endgeneration" not in template:
        # transformers' assistant mask comes from these tags only: without them it is all zeros
        c.bad(f"{key}.chat.template", f"the chat template ({origin}) has no {{% generation %}} tags, so the "
              "processor's assistant mask would be empty: name a training template that has them (TRL ships one "
              "per model family, e.g. qwen2_5_vl_training.jinja), or set chat.train_on: all")
        return None
    return {"processor": path, "image_backend": backend, "processor_hash": info.digest, "chat": chat,
            "image_pass": image_pass, **video}


def _user_code(c: _Checker, key: str, raw: dict, fmt: Any, tokenizer: str | None, base: str) -> dict[str, Any] | None:
    """A source's transform (imported here, so a missing module or function is named now, and
    hashed: the job's identity) or chat block (its template found and compiled). None: a problem."""
    out: dict[str, Any] = {}
    ok = True
    transform, chat = raw.get("transform"), raw.get("chat")
    if transform is not None and chat is not None:
        c.bad(key, "transform and chat do not go together (a transform may render chat itself)")
        return None
    for k in ("transform_args", "max_transform_errors"):
        if k in raw and transform is None:
            c.bad(f"{key}.{k}", "applies to a source with a transform only")
            ok = False
    if transform is not None:
        if not isinstance(transform, str):
            c.bad(f"{key}.transform", f"expected 'package.module:function', got {transform!r}")
            return None
        args = raw.get("transform_args", {})
        if not isinstance(args, dict) or not all(isinstance(a, str) for a in args):
            c.bad(f"{key}.transform_args", "expected a mapping of keyword arguments")
            ok = False
        else:
            try:
                orjson.dumps(args)
            except TypeError as e:
                c.bad(f"{key}.transform_args", f"not plain data ({e})")
                ok = False
        errors = c.integer(raw.get("max_transform_errors", 100), f"{key}.max_transform_errors", 1)
        try:
            digest = code_hash(transform)
        except TransformImportError as e:
            c.bad(f"{key}.transform", str(e))
            return None
        if not ok or errors is None:
            return None
        out.update(transform=transform, transform_args=dict(args) or None, transform_hash=digest,
                   max_transform_errors=errors)
    if chat is not None:
        chat = c.mapping(chat, f"{key}.chat", allowed(f"{SRC}.chat"))
        if fmt not in (PROCESSOR_FORMATS if raw.get("processor") is not None else CHAT_FORMATS):
            c.bad(f"{key}.chat", f"for {', '.join(CHAT_FORMATS)} sources, not {fmt}")
            return None
        train_on = chat.get("train_on", "assistant")
        if _choice(c, train_on, f"{key}.chat.train_on", TRAIN_ON) is False:
            ok = False
        for k in ("messages_key", "tools_key"):
            if k in chat and (not isinstance(chat[k], str) or not chat[k]):
                c.bad(f"{key}.chat.{k}", "expected a non-empty field name")
                ok = False
        template = _template_file(c, f"{key}.chat.template", chat.get("template"), base)
        if template is False:
            ok = False
        if raw.get("processor") is not None:  # the processor's template (checked in _processor)
            pass
        elif raw.get("tokenizer", "byte") == "byte":
            c.bad(f"{key}.tokenizer", "chat needs a Hugging Face tokenizer directory with a chat template")
            return None
        elif tokenizer is not None and template is not False:
            try:
                compile_template(template[0] if template else tokenizer)
            except (ChatError, OSError, ValueError) as e:
                c.bad(f"{key}.chat", str(e))
                ok = False
        if not ok:
            return None
        out["chat"] = {"messages_key": chat.get("messages_key", "messages"), "train_on": train_on,
                       "tools_key": chat.get("tools_key", "tools")}
        if template:  # its path (for the workers) and its content's hash (the stream's identity)
            out["chat"].update(template=template[0], template_hash=template[1])
    return out if ok else None


def _template_file(c: _Checker, where: str, value: Any, base: str) -> tuple[str, str] | None | bool:
    """`chat.template`: (absolute path, content hash) of a readable jinja file; None when not
    given; False on a problem (named)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        c.bad(where, f"expected the path of a jinja chat template file, got {value!r}")
        return False
    path = os.path.join(base, os.path.expanduser(value))
    try:
        with open(path, "rb") as f:
            text = f.read()
        text.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        c.bad(where, f"{path}: cannot read the template ({e})")
        return False
    return path, hashlib.sha256(text).hexdigest()[:16]


def _check_hf_tokenizer(c: _Checker, key: str, path: str, eod_id: Any) -> bool:
    from .tokenizer import find_eod_id, resolve

    try:
        from tokenizers import Tokenizer

        file, eos = resolve(path)
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the library raises its own exception types for bad files
        c.bad(f"{key}.tokenizer", f"{path}: not a valid tokenizer.json or tokenizer directory ({e})")
        return False
    if eod_id is None:
        try:
            find_eod_id(tok, path, eos)
        except ValueError as e:
            c.bad(f"{key}.eod_id", str(e))
            return False
    return True


def parse_job(raw: Any, path: str = "<job>", base_dir: str | None = None) -> JobConfig:
    """Validate a decoded job file; raise ConfigError listing every problem."""
    c = _Checker()
    base = base_dir if base_dir is not None else os.path.dirname(os.path.abspath(path))
    top = c.mapping(raw, "", allowed(""), required(""))
    defaults = {}  # job-wide defaults a source may override
    if "long_docs" in top and _choice(c, top["long_docs"], "long_docs", LONG_DOCS):
        defaults["long_docs"] = top["long_docs"]
    if "on_exhausted" in top and _choice(c, top["on_exhausted"], "on_exhausted", ON_EXHAUSTED):
        defaults["on_exhausted"] = top["on_exhausted"]
    seed = top.get("seed")
    if "seed" in top and (type(seed) is not int or not 0 <= seed < 2**63):
        c.bad("seed", f"expected a non-negative integer, got {seed!r}")

    sources: list[SourceConfig] = []
    names: list[str] = []
    raw_sources = top.get("sources", {})
    if not isinstance(raw_sources, dict) or not raw_sources:
        if "sources" in top:
            c.bad("sources", "expected a non-empty mapping of source name -> definition")
    else:
        if len(raw_sources) > MAX_SOURCES:
            c.bad("sources", f"at most {MAX_SOURCES} sources (doc_keys hold 15 bits of source)")
        for i, (name, spec) in enumerate(raw_sources.items()):
            names.append(str(name))
            s = _source(c, name, spec, i, base, defaults)
            if s:
                sources.append(s)

    b = c.mapping(top.get("batch", {}), "batch", allowed("batch"), required("batch"))
    seq_len = c.integer(b.get("seq_len", 1), "batch.seq_len", 2)
    mbs = c.integer(b.get("micro_batch_size", 1), "batch.micro_batch_size")
    gbs = c.integer(b.get("global_batch_size", 1), "batch.global_batch_size")
    pad_id = c.integer(b.get("pad_id", 257), "batch.pad_id", 0)

    t = c.mapping(top.get("topology", {}), "topology", allowed("topology"), required("topology"))
    dp = c.integer(t.get("dp", 1), "topology.dp")
    pp = c.integer(t.get("pp", 1), "topology.pp") or 1
    cp = c.integer(t.get("cp", 1), "topology.cp") or 1
    tp = c.integer(t.get("tp", 1), "topology.tp") or 1
    order = t.get("order", DEFAULT_ORDER)
    if not isinstance(order, str) or sorted(order.split("-")) != sorted(AXES):
        c.bad("topology.order", f"expected the four axes {', '.join(AXES)} joined by '-', fastest first; got {order!r}")
        order = DEFAULT_ORDER
    delivery = t.get("delivery", "tp_leader")
    _choice(c, delivery, "topology.delivery", DELIVERY)
    if mbs and gbs and dp and gbs % (dp * mbs):
        c.bad("batch.global_batch_size", f"{gbs} is not a multiple of topology.dp x micro_batch_size = {dp * mbs}")

    stages = _stages(c, top.get("mixture", {}), names)
    mixture = top.get("mixture")
    adapt = _adapt(c, mixture.get("adapt"), names) if isinstance(mixture, dict) else None

    bal = c.mapping(top.get("balance", {}), "balance", allowed("balance"))
    calibrate = bal.get("calibrate", False)
    if not isinstance(calibrate, bool):
        c.bad("balance.calibrate", f"expected true or false, got {calibrate!r}")
        calibrate = False
    method = bal.get("method", "greedy")
    _choice(c, method, "balance.method", METHODS)
    slack = c.number(bal.get("token_slack", 0.0), "balance.token_slack")
    cost_raw = c.mapping(bal.get("cost", {}), "balance.cost", allowed("balance.cost"))
    cost = CostConfig(*(c.number(cost_raw.get(k, default), f"balance.cost.{k}") for k, default in
                        (("quadratic", 1.0), ("linear", 0.0), ("patch_quadratic", 0.0), ("patch_linear", 0.0))))

    rt = c.mapping(top.get("runtime", {}), "runtime", allowed("runtime"))
    lookahead = c.integer(rt.get("lookahead_steps", 4), "runtime.lookahead_steps")
    heartbeat = c.number(rt.get("heartbeat_s", 1.0), "runtime.heartbeat_s")
    if heartbeat is not None and heartbeat <= 0:
        c.bad("runtime.heartbeat_s", "must be > 0")
    # a processor's sample holds megabytes of pixel values, kept in the worker until delivered: a
    # prepare task of 64 of them held 600 MB (tools/bench_vlm.py: 8 gives the same throughput)
    default_batch = PROCESSOR_PREPARE_BATCH if any(s.processor for s in sources) else 64
    prepare_batch = c.integer(rt.get("prepare_batch", default_batch), "runtime.prepare_batch")
    status_every = c.number(rt.get("status_every_s", 30.0), "runtime.status_every_s")
    allocation = rt.get("allocation", "adaptive")
    _choice(c, allocation, "runtime.allocation", ALLOCATIONS)
    shrink_after = c.number(rt.get("shrink_after_s", 10.0), "runtime.shrink_after_s")
    stimulus_mb = c.number(rt.get("stimulus_log_mb", 4.0), "runtime.stimulus_log_mb")
    if stimulus_mb is not None and stimulus_mb < 0:
        c.bad("runtime.stimulus_log_mb", "must be >= 0")
    cache_dir = rt.get("cache_dir")
    if cache_dir is not None:
        if not isinstance(cache_dir, str) or not cache_dir:
            c.bad("runtime.cache_dir", f"expected a directory path, got {cache_dir!r}")
            cache_dir = None
        else:  # relative to the job file, like source paths
            cache_dir = os.path.join(base, os.path.expanduser(cache_dir))
    cache_bytes = c.integer(rt.get("cache_bytes", DEFAULT_CACHE_BYTES), "runtime.cache_bytes", 1)
    index_on = rt.get("index_on", "coordinator")
    _choice(c, index_on, "runtime.index_on", INDEX_ON)
    copies = rt.get("copies", "plain")
    _choice(c, copies, "runtime.copies", COPIES)
    ahead_bytes = c.integer(rt.get("ahead_bytes", DEFAULT_AHEAD_BYTES), "runtime.ahead_bytes")
    linger = c.number(rt.get("failed_linger_s", 600.0), "runtime.failed_linger_s")
    if linger is not None and linger < 0:
        c.bad("runtime.failed_linger_s", "must be >= 0")

    sec = c.mapping(top.get("security", {}), "security", allowed("security"))
    curve = sec.get("curve")
    if curve is not None:
        if not isinstance(curve, str):
            c.bad("security.curve", f"expected the path of a key directory (msd keys generate DIR), got {curve!r}")
            curve = None
        else:
            curve = os.path.join(base, os.path.expanduser(curve))
            if not os.path.isfile(os.path.join(curve, "coordinator.key_secret")):
                c.bad("security.curve", f"{curve}: no coordinator.key_secret (make keys with: msd keys generate DIR)")

    eval_sets = _eval_sets(c, top.get("eval"), names)
    image_sources = [s for s in sources if s.has_images]
    if len({s.patch_size for s in image_sources}) > 1:
        c.bad("sources", "every webdataset source must have the same patch_size (one pixel_patches array per batch)")
    processors = [s for s in sources if s.processor is not None]
    if len({s.processor_hash for s in processors}) > 1:
        c.bad("sources", "sources with a processor must share one processor directory (one model: "
                         f"{', '.join(s.name for s in processors)} name different ones)")
    if (processors or image_sources) and cp > 1:
        c.bad("topology.cp", "context parallelism with image sources is not supported yet")
    if image_sources and processors:
        c.bad("sources", "built-in image patches (webdataset, image_token_id) and a processor's images do not mix "
                         "in one job")
    if image_sources and cp > 1 and not processors:
        c.bad("topology.cp", "context parallelism with image-text sources is not supported yet")
    if c.problems:
        raise ConfigError(path, c.problems)
    return JobConfig(
        seed=seed,
        sources=tuple(sources),
        batch=BatchConfig(seq_len, mbs, gbs, pad_id),
        dp=dp,
        topology=Topology(dp, pp, cp, tp, order, delivery),
        stages=stages,
        cost=cost,
        curve_keys=curve,
        balance_method=method,
        token_slack=slack,
        calibrate=calibrate, adapt=adapt,
        runtime=RuntimeConfig(lookahead, heartbeat, prepare_batch, status_every, allocation, shrink_after, stimulus_mb,
                              cache_dir, cache_bytes or DEFAULT_CACHE_BYTES, index_on, copies,
                              600.0 if linger is None else float(linger), ahead_bytes or DEFAULT_AHEAD_BYTES),
        path=path,
        eval_sets=eval_sets,
    )




def _eval_sets(c: _Checker, raw: Any, names: list[str]) -> tuple[EvalSetConfig, ...]:
    """`eval: {name: {holdout: {source: share | count}, sources: [names], max_records, seq_len,
    prepare_ahead}}`."""
    if raw is None:
        return ()
    if not isinstance(raw, dict) or not raw:
        c.bad("eval", "expected a mapping of eval set name -> definition")
        return ()
    out = []
    for i, (name, spec) in enumerate(raw.items()):
        key = f"eval.{name}"
        if not isinstance(name, str) or not name:
            c.bad(key, "eval set names must be non-empty strings")
            continue
        spec = c.mapping(spec, key, allowed(EVAL))
        holdout = []
        raw_holdout = spec.get("holdout", {})
        if not isinstance(raw_holdout, dict):
            c.bad(f"{key}.holdout", "expected a mapping of source -> share (0 < x < 1) or count (an integer >= 1)")
            raw_holdout = {}
        for src, amount in raw_holdout.items():
            where = f"{key}.holdout.{src}"
            if src not in names:
                c.bad(where, f"unknown source (sources: {', '.join(names)})")
            elif type(amount) is float and 0.0 < amount < 1.0:
                holdout.append((names.index(src), amount))
            elif type(amount) is int and amount >= 1:
                holdout.append((names.index(src), amount))
            else:
                c.bad(where,
                      f"expected a share (a number between 0 and 1) or a count (an integer >= 1), got {amount!r}")
        sources = spec.get("sources", [])
        if not isinstance(sources, list) or not all(isinstance(x, str) for x in sources):
            c.bad(f"{key}.sources", "expected a list of source names")
            sources = []
        for src in sources:
            if src not in names:
                c.bad(f"{key}.sources", f"unknown source {src!r} (sources: {', '.join(names)})")
        if not raw_holdout and not sources:
            c.bad(key, "an eval set needs holdout or sources")
        max_records = spec.get("max_records")
        if max_records is not None and c.integer(max_records, f"{key}.max_records") is None:
            max_records = None
        seq_len = spec.get("seq_len")
        if seq_len is not None and c.integer(seq_len, f"{key}.seq_len", 2) is None:
            seq_len = None
        ahead = spec.get("prepare_ahead", False)
        if not isinstance(ahead, bool):
            c.bad(f"{key}.prepare_ahead", f"expected true or false, got {ahead!r}")
            ahead = False
        out.append(EvalSetConfig(name, i, tuple(holdout), tuple(names.index(x) for x in sources if x in names),
                                 max_records, seq_len, ahead))
    return tuple(out)


def _stages(c: _Checker, mixture: Any, names: list[str]) -> tuple[Stage, ...]:
    """`mixture: {weights: ...}` (one stage), or a list of stages: every stage but the last ends
    at its `until_step`; a stage may ramp from the previous weights and change seq_len."""
    if not isinstance(mixture, list):
        weights = _weights(c, mixture, names, "mixture", allowed("mixture"))
        return (Stage(tuple(weights.get(n, 0.0) for n in names)),)
    if not mixture:
        c.bad("mixture", "expected at least one stage")
        return ()
    stages, start = [], 0
    for i, raw in enumerate(mixture):
        key = f"mixture[{i}]"
        last = i == len(mixture) - 1
        weights = _weights(c, raw, names, key, allowed("mixture[]"))
        if not isinstance(raw, dict):
            continue
        until = raw.get("until_step")
        if until is None and not last:
            c.bad(f"{key}.until_step", "required on every stage but the last")
        elif until is not None:
            if last:
                c.bad(f"{key}.until_step", "the last stage runs to the end of the job: leave until_step out")
            elif c.integer(until, f"{key}.until_step", start + 1) is None:
                until = None
        ramp = raw.get("ramp_steps", 0)
        if c.integer(ramp, f"{key}.ramp_steps", 0) is None:
            ramp = 0
        elif ramp and i == 0:
            c.bad(f"{key}.ramp_steps", "the first stage has no previous weights to ramp from")
        elif ramp and isinstance(until, int) and ramp > until - start:
            c.bad(f"{key}.ramp_steps", f"{ramp} is longer than the stage ({until - start} steps)")
        seq_len = raw.get("seq_len")
        if seq_len is not None and c.integer(seq_len, f"{key}.seq_len", 2) is None:
            seq_len = None
        stages.append(Stage(tuple(weights.get(n, 0.0) for n in names), until, ramp, seq_len))
        if isinstance(until, int):
            start = until
    return tuple(stages)


def _adapt(c: _Checker, raw: Any, names: list[str]) -> AdaptConfig | None:
    """mixture.adapt, checked (a user's policy imported and its code hashed), or None."""
    if raw is None:
        return None
    where = "mixture.adapt"
    m = c.mapping(raw, where, allowed(where), {"policy", "every_steps"})
    policy, policy_hash = m.get("policy"), None
    if not isinstance(policy, str) or (policy not in ADAPT_POLICIES and ":" not in policy):
        c.bad(f"{where}.policy", f"expected one of {', '.join(ADAPT_POLICIES)} or package.module:function, "
                                 f"got {policy!r}")
    elif ":" in policy:
        from .usercode import TransformImportError, code_hash, load

        try:
            load(policy)
            policy_hash = code_hash(policy)
        except TransformImportError as e:
            c.bad(f"{where}.policy", str(e).replace("transform ", "policy ", 1))
    every = c.integer(m.get("every_steps"), f"{where}.every_steps", 1) if "every_steps" in m else None
    warmup = c.integer(m.get("warmup_steps", 0), f"{where}.warmup_steps", 0)
    min_weight = c.number(m.get("min_weight", 0.0), f"{where}.min_weight")
    change = c.number(m.get("max_step_change", 1.0), f"{where}.max_step_change")
    if change is not None and change <= 0:
        c.bad(f"{where}.max_step_change", f"must be > 0, got {change:g}")
    sources = m.get("sources", list(names))
    if not isinstance(sources, list) or any(s not in names for s in sources) or len(set(sources)) < 2:
        c.bad(f"{where}.sources", f"expected a list of at least two of the job's sources ({', '.join(names)}), "
                                  f"got {sources!r}")
        sources = list(names)
    if min_weight is not None and min_weight * len(set(sources)) >= 1:
        c.bad(f"{where}.min_weight", f"{min_weight:g} x {len(set(sources))} adapted sources leaves no room to adapt")
    if None in (every, warmup, min_weight, change) or not isinstance(policy, str):
        return None
    return AdaptConfig(policy, every, min_weight, change, warmup,
                       tuple(n for n in names if n in sources) if set(sources) != set(names) else (), policy_hash)


def _weights(c: _Checker, mixture: Any, names: list[str], where: str, allowed: set[str]) -> dict[str, float]:
    m = c.mapping(mixture, where, allowed, {"weights"})
    raw = c.mapping(m.get("weights", {}), f"{where}.weights", set(names) | set(m.get("weights", {}) or {}))
    weights: dict[str, float] = {}
    for name, w in raw.items():
        key = f"{where}.weights.{name}"
        if name not in names:
            c.bad(key, f"weight for unknown source (sources: {', '.join(names)})")
            continue
        v = c.number(w, key)
        if v is not None:
            weights[name] = v
    if raw and weights and sum(weights.values()) <= 0:
        c.bad(f"{where}.weights", "all weights are zero")
    if "weights" in m and not raw:
        c.bad(f"{where}.weights", "expected at least one source weight")
    total = sum(weights.values())
    return {n: weights.get(n, 0.0) / total for n in names} if total > 0 else {}


def load_job(path: str) -> JobConfig:
    """Read and validate a job file."""
    import yaml  # (here: a worker imports this module for the spec's types, and needs no YAML)

    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(path, [f"cannot read: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError(path, [f"not valid YAML: {e}"]) from None
    return parse_job(raw, path)
