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
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import yaml

from trainer_client.errors import MsdError

FORMATS = ("jsonl", "megatron")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst")


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
    files: tuple[str, ...]  # JSONL shard paths, or Megatron prefixes; sorted, absolute
    text_key: str = "text"
    tokenizer: str = "byte"  # "byte" or an absolute path to a HF tokenizer.json
    eod_id: int | None = None


@dataclass(frozen=True)
class BatchConfig:
    seq_len: int
    micro_batch_size: int
    global_batch_size: int  # sequences per step
    pad_id: int = 257


@dataclass(frozen=True)
class CostConfig:
    quadratic: float = 1.0
    linear: float = 0.0

    def of(self, length: int) -> float:
        return self.quadratic * length * length + self.linear * length


@dataclass(frozen=True)
class RuntimeConfig:
    lookahead_steps: int = 4  # steps planned ahead of the slowest rank's consumed step
    heartbeat_s: float = 1.0
    prepare_batch: int = 64  # records per prepare task


@dataclass(frozen=True)
class JobConfig:
    seed: int
    sources: tuple[SourceConfig, ...]
    batch: BatchConfig
    dp: int
    weights: dict[str, float]  # normalised to sum 1
    cost: CostConfig
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    path: str = "<job>"

    @property
    def micro_batches_per_rank(self) -> int:
        return self.batch.global_batch_size // (self.dp * self.batch.micro_batch_size)

    @property
    def step_tokens(self) -> int:
        return self.batch.global_batch_size * self.batch.seq_len

    def source(self, name: str) -> SourceConfig:
        return next(s for s in self.sources if s.name == name)

    def worker_job(self) -> dict[str, Any]:
        """What workers need to read and transform: the source definitions, nothing about the plan."""
        return {
            "seed": self.seed,
            "sources": [
                {"name": s.name, "index": s.index, "format": s.format, "files": list(s.files),
                 "text_key": s.text_key, "tokenizer": s.tokenizer, "eod_id": s.eod_id}
                for s in self.sources
            ],
        }

    def digest(self) -> str:
        """Fingerprint of everything that defines the stream of batches (not runtime knobs)."""
        order_defining = {
            "seed": self.seed,
            "sources": [asdict(s) for s in self.sources],
            "batch": asdict(self.batch),
            "dp": self.dp,
            "weights": self.weights,
            "cost": asdict(self.cost),
        }
        return hashlib.sha256(orjson.dumps(order_defining, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


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


def _expand(pattern: str, base: str, fmt: str) -> list[str]:
    pattern = os.path.join(base, os.path.expanduser(pattern))
    if fmt == "megatron":
        prefix_pattern = pattern[:-4] if pattern.endswith((".bin", ".idx")) else pattern
        return sorted({p[:-4] for p in glob.glob(prefix_pattern + ".idx")})
    return sorted(p for p in glob.glob(pattern) if os.path.isfile(p))


def _source(c: _Checker, name: Any, raw: Any, index: int, base: str) -> SourceConfig | None:
    key = f"sources.{name}"
    if not isinstance(name, str) or not name:
        c.bad(key, "source names must be non-empty strings")
        return None
    raw = c.mapping(raw, key, {"format", "paths", "text_key", "tokenizer", "eod_id"}, {"format", "paths"})
    fmt = raw.get("format")
    ok = True
    if "format" in raw and fmt not in FORMATS:
        c.bad(f"{key}.format", f"unknown format {fmt!r} (expected one of: {', '.join(FORMATS)})")
        ok = False
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
                matched = _expand(p, base, fmt)
                if not matched:
                    what = "no .idx file" if fmt == "megatron" else "no file"
                    c.bad(f"{key}.paths", f"{p!r} matches {what}")
                    ok = False
                files.extend(matched)
            if fmt == "jsonl":
                for f in files:
                    if not f.endswith(JSONL_SUFFIXES):
                        c.bad(f"{key}.paths", f"{f}: not one of {', '.join(JSONL_SUFFIXES)}")
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
        if not os.path.isfile(tokenizer):
            c.bad(f"{key}.tokenizer", f"unknown tokenizer {raw['tokenizer']!r}: not 'byte' and no such file")
            ok = False
        else:
            ok = _check_hf_tokenizer(c, key, tokenizer, raw.get("eod_id")) and ok
    text_key = raw.get("text_key", "text")
    if not isinstance(text_key, str) or not text_key:
        c.bad(f"{key}.text_key", "expected a non-empty string")
        ok = False
    eod_id = raw.get("eod_id")
    if eod_id is not None and c.integer(eod_id, f"{key}.eod_id", 0) is None:
        ok = False
    if not ok:
        return None
    return SourceConfig(name, index, fmt, tuple(files), text_key, tokenizer, eod_id)


def _check_hf_tokenizer(c: _Checker, key: str, path: str, eod_id: Any) -> bool:
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(path)
    except Exception as e:  # the library raises its own exception types for bad files
        c.bad(f"{key}.tokenizer", f"{path}: not a valid tokenizer.json ({e})")
        return False
    if eod_id is None:
        from worker.tokenizer import find_eod_id

        try:
            find_eod_id(tok, path)
        except ValueError as e:
            c.bad(f"{key}.eod_id", str(e))
            return False
    return True


def parse_job(raw: Any, path: str = "<job>", base_dir: str | None = None) -> JobConfig:
    """Validate a decoded job file; raise ConfigError listing every problem."""
    c = _Checker()
    base = base_dir if base_dir is not None else os.path.dirname(os.path.abspath(path))
    top = c.mapping(raw, "", {"seed", "sources", "batch", "topology", "mixture", "balance", "runtime"},
                    {"seed", "sources", "batch", "topology", "mixture"})
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
        if len(raw_sources) > 0xFFFF:
            c.bad("sources", "at most 65535 sources")
        for i, (name, spec) in enumerate(raw_sources.items()):
            names.append(str(name))
            s = _source(c, name, spec, i, base)
            if s:
                sources.append(s)

    b = c.mapping(top.get("batch", {}), "batch", {"seq_len", "micro_batch_size", "global_batch_size", "pad_id"},
                  {"seq_len", "micro_batch_size", "global_batch_size"})
    seq_len = c.integer(b.get("seq_len", 1), "batch.seq_len", 2)
    mbs = c.integer(b.get("micro_batch_size", 1), "batch.micro_batch_size")
    gbs = c.integer(b.get("global_batch_size", 1), "batch.global_batch_size")
    pad_id = c.integer(b.get("pad_id", 257), "batch.pad_id", 0)

    t = c.mapping(top.get("topology", {}), "topology", {"dp"}, {"dp"})
    dp = c.integer(t.get("dp", 1), "topology.dp")
    if mbs and gbs and dp and gbs % (dp * mbs):
        c.bad("batch.global_batch_size", f"{gbs} is not a multiple of topology.dp x micro_batch_size = {dp * mbs}")

    weights = _weights(c, top.get("mixture", {}), names)

    bal = c.mapping(top.get("balance", {}), "balance", {"cost"})
    cost_raw = c.mapping(bal.get("cost", {}), "balance.cost", {"quadratic", "linear"})
    quadratic = c.number(cost_raw.get("quadratic", 1.0), "balance.cost.quadratic")
    linear = c.number(cost_raw.get("linear", 0.0), "balance.cost.linear")

    rt = c.mapping(top.get("runtime", {}), "runtime", {"lookahead_steps", "heartbeat_s", "prepare_batch"})
    lookahead = c.integer(rt.get("lookahead_steps", 4), "runtime.lookahead_steps")
    heartbeat = c.number(rt.get("heartbeat_s", 1.0), "runtime.heartbeat_s")
    if heartbeat is not None and heartbeat <= 0:
        c.bad("runtime.heartbeat_s", "must be > 0")
    prepare_batch = c.integer(rt.get("prepare_batch", 64), "runtime.prepare_batch")

    if c.problems:
        raise ConfigError(path, c.problems)
    return JobConfig(
        seed=seed,
        sources=tuple(sources),
        batch=BatchConfig(seq_len, mbs, gbs, pad_id),
        dp=dp,
        weights=weights,
        cost=CostConfig(quadratic, linear),
        runtime=RuntimeConfig(lookahead, heartbeat, prepare_batch),
        path=path,
    )


def _weights(c: _Checker, mixture: Any, names: list[str]) -> dict[str, float]:
    m = c.mapping(mixture, "mixture", {"weights"}, {"weights"})
    raw = c.mapping(m.get("weights", {}), "mixture.weights", set(names) | set(m.get("weights", {}) or {}))
    weights: dict[str, float] = {}
    for name, w in raw.items():
        key = f"mixture.weights.{name}"
        if name not in names:
            c.bad(key, f"weight for unknown source (sources: {', '.join(names)})")
            continue
        v = c.number(w, key)
        if v is not None:
            weights[name] = v
    if raw and weights and sum(weights.values()) <= 0:
        c.bad("mixture.weights", "all weights are zero")
    if "weights" in m and not raw:
        c.bad("mixture.weights", "expected at least one source weight")
    total = sum(weights.values())
    return {n: weights.get(n, 0.0) / total for n in names} if total > 0 else {}


def load_job(path: str) -> JobConfig:
    """Read and validate a job file."""
    try:
        with open(path, "rb") as f:
            raw = yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(path, [f"cannot read: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError(path, [f"not valid YAML: {e}"]) from None
    return parse_job(raw, path)
