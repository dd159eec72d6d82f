"""Shared fixtures: a small real multi-source dataset (JSONL with bad lines, zstd JSONL of long
documents, a Megatron pair) and job files over it."""

from __future__ import annotations

import os

import numpy as np
import orjson
import pytest
import yaml
import zstandard

from msd_common.formats.megatron import write_megatron
from msd_common.tokenizer import ByteTokenizer


def _text(rng: np.random.Generator, n_words: int) -> str:
    words = ["data", "loader", "coordinator", "worker", "rank", "token", "ünïcode", "batch", "plan", "séquence",
             "attention", "cost", "piece", "shard", "λ", "mix"]
    return " ".join(words[i] for i in rng.integers(0, len(words), n_words))


def build_dataset(root: str, seed: int = 0) -> dict[str, str]:
    """Writes the dataset; returns the paths of interest (including the bad JSONL lines' file)."""
    rng = np.random.default_rng(seed)
    os.makedirs(f"{root}/web", exist_ok=True)
    os.makedirs(f"{root}/code", exist_ok=True)
    os.makedirs(f"{root}/long", exist_ok=True)
    # web: two plain shards; shard 1 has a corrupt JSON line (line 3) and invalid UTF-8 (line 5)
    for shard in range(2):
        lines = [orjson.dumps({"text": _text(rng, int(rng.integers(5, 300)))}) for _ in range(60)]
        if shard == 1:
            lines[2] = b'{"text": "unterminated'
            lines[4] = b'{"text": "bad \xff\xfe bytes"}'
        with open(f"{root}/web/web-{shard}.jsonl", "wb") as f:
            f.write(b"\n".join(lines) + b"\n")
    # long: zstd-compressed documents of 3k-20k bytes
    long_lines = b"".join(orjson.dumps({"body": _text(rng, int(rng.integers(400, 2500)))}) + b"\n" for _ in range(25))
    with open(f"{root}/long/long-0.jsonl.zst", "wb") as f:
        f.write(zstandard.ZstdCompressor().compress(long_lines))
    # code: a Megatron pair of byte-tokenized documents
    tok = ByteTokenizer()
    write_megatron(f"{root}/code/code_text_document",
                   [tok.encode(_text(rng, int(rng.integers(20, 900)))) for _ in range(80)], np.uint16)
    return {"bad_shard": f"{root}/web/web-1.jsonl"}


def job_dict(**overrides) -> dict:
    job = {
        "seed": 1234,
        "sources": {
            "web": {"format": "jsonl", "paths": ["web/*.jsonl"], "text_key": "text", "tokenizer": "byte"},
            "code": {"format": "megatron", "paths": ["code/code_text_document"]},
            "long": {"format": "jsonl", "paths": ["long/*.jsonl.zst"], "text_key": "body"},
        },
        "batch": {"seq_len": 512, "micro_batch_size": 2, "global_batch_size": 8},
        "topology": {"dp": 2},
        "mixture": {"weights": {"web": 0.5, "code": 0.3, "long": 0.2}},
        "balance": {"cost": {"quadratic": 1.0, "linear": 0.0}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 16, "lookahead_steps": 3},
    }
    for k, v in overrides.items():
        job[k] = v
    return job


def write_job(root: str, job: dict, name: str = "job.yaml") -> str:
    path = os.path.join(root, name)
    with open(path, "w") as f:
        yaml.safe_dump(job, f, sort_keys=False)
    return path


@pytest.fixture(scope="session")
def dataset_dir(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("data"))
    build_dataset(root)
    return root


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MSD_CACHE_DIR", str(tmp_path / "cache"))


def train_tokenizer(path: str, texts: list[str], eod: str | None = "<|endoftext|>") -> str:
    """A real HF byte-level BPE tokenizer, trained here on local text (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = [eod] if eod else []
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(path)
    return path
