"""The demo's multi-source dataset, generated on first use from real local text (no network):

- `web`:  docstrings of the Python standard library, as JSONL shards compressed with zstd;
- `code`: the standard library's `.py` sources, byte-tokenized into a Megatron `.bin/.idx` pair;
- `long`: long documents (several modules' sources joined, 16-64 KiB each), as plain JSONL.

Deterministic: the same Python installation gives the same dataset.
"""

from __future__ import annotations

import ast
import os
import sysconfig

import numpy as np
import orjson
import zstandard

from msd_common.formats.megatron import write_megatron
from msd_common.tokenizer import ByteTokenizer

DEMO_VERSION = 1
MAX_FILES = 1200


def _stdlib_sources(limit: int = MAX_FILES) -> list[tuple[str, str]]:
    root = sysconfig.get_paths()["stdlib"]
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "idlelib",
                                                              "__pycache__"))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    out = []
    for path in sorted(found)[:limit]:
        try:
            with open(path, encoding="utf-8") as f:
                out.append((os.path.relpath(path, root), f.read()))
        except (UnicodeDecodeError, OSError):
            continue
    return out


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                docs.append(doc)
    return docs


def ensure_demo_data(data_dir: str) -> str:
    """Create the dataset under data_dir unless it is there already; return the job file's path."""
    stamp = os.path.join(data_dir, f".complete-v{DEMO_VERSION}")
    job_path = os.path.join(data_dir, "demo.yaml")
    if os.path.exists(stamp):
        return job_path
    os.makedirs(os.path.join(data_dir, "web"), exist_ok=True)
    os.makedirs(os.path.join(data_dir, "code"), exist_ok=True)
    os.makedirs(os.path.join(data_dir, "long"), exist_ok=True)
    files = _stdlib_sources()

    docs = [d for _, src in files for d in _docstrings(src)]
    shards = 4
    cctx = zstandard.ZstdCompressor(level=3)
    for i in range(shards):
        lines = b"".join(orjson.dumps({"text": d, "id": j}) + b"\n" for j, d in enumerate(docs) if j % shards == i)
        with open(os.path.join(data_dir, "web", f"web-{i:03d}.jsonl.zst"), "wb") as f:
            f.write(cctx.compress(lines))

    tok = ByteTokenizer()
    write_megatron(os.path.join(data_dir, "code", "code_text_document"), (tok.encode(src) for _, src in files),
                   np.uint16)

    long_docs, current = [], []
    target = 16 << 10
    for _, src in files:
        current.append(src)
        if sum(map(len, current)) >= target:
            long_docs.append("\n\n".join(current))
            current = []
            target = (16 << 10) * (1 + len(long_docs) % 4)  # 16, 32, 48, 64 KiB
    with open(os.path.join(data_dir, "long", "long-000.jsonl"), "wb") as f:
        for d in long_docs:
            f.write(orjson.dumps({"text": d}) + b"\n")

    with open(job_path, "w") as f:
        f.write(DEMO_JOB)
    with open(stamp, "w") as f:
        f.write(f"{len(docs)} web docs, {len(files)} code files, {len(long_docs)} long docs\n")
    return job_path


DEMO_JOB = """\
# The demo job of `msd demo`; --ranks changes topology.dp and the global batch.
seed: 1234
sources:
  web:
    format: jsonl
    paths: ["web/*.jsonl.zst"]
    text_key: text
    tokenizer: byte
  code:
    format: megatron
    paths: ["code/code_text_document"]
  long:
    format: jsonl
    paths: ["long/*.jsonl"]
batch: {seq_len: 4096, micro_batch_size: 1, global_batch_size: 8}
topology: {dp: 2}
mixture: {weights: {web: 0.5, code: 0.3, long: 0.2}}
balance: {cost: {quadratic: 1.0, linear: 0.0}}
"""
