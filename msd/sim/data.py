"""The simulation's dataset, in real formats, written once per machine (the same bytes every
time: every seed reads the same files):

- `web`: JSONL shards of byte-tokenized text, 10 B to 2 KB a document, with corrupt lines that
  workers skip;
- `code`: a Megatron `.bin/.idx` pair (memory-mapped: the coordinator knows its lengths);
- `books`: JSONL of longer documents, 1-6 KB.
"""

from __future__ import annotations

import os
import random

import numpy as np
import orjson

from msd_common.formats.megatron import write_megatron

DATA_VERSION = 1
WORDS = ("data loader plan step rank worker relay coordinator token sample mixture curriculum batch "
         "attention cost balance stream cursor journal checkpoint resume epoch shard record").split()


def _text(rng: random.Random, size: int) -> str:
    out, n = [], 0
    while n < size:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:size]


def dataset_dir() -> str:
    """The dataset's directory (MSD_SIM_DATA, else under the user's cache), written if missing."""
    root = os.environ.get("MSD_SIM_DATA") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "msd", f"sim-data-v{DATA_VERSION}")
    if not os.path.exists(os.path.join(root, "complete")):
        _write(root)
    return root


def _write(root: str) -> None:
    rng = random.Random(20261206)
    for d in ("web", "code", "books"):
        os.makedirs(os.path.join(root, d), exist_ok=True)
    for shard in range(2):
        with open(os.path.join(root, "web", f"web-{shard}.jsonl"), "wb") as f:
            for i in range(300):
                if i % 97 == 13:
                    f.write(b'{"text": "a line cut sh\n')  # corrupt: skipped by workers, the same each time
                    continue
                f.write(orjson.dumps({"text": _text(rng, rng.randint(10, 2000))}) + b"\n")
    docs = [np.array([rng.randrange(1, 250) for _ in range(rng.randint(5, 1500))], dtype=np.uint16)
            for _ in range(500)]
    write_megatron(os.path.join(root, "code", "code_text_document"), docs)
    with open(os.path.join(root, "books", "books.jsonl"), "wb") as f:
        for _ in range(150):
            f.write(orjson.dumps({"body": _text(rng, rng.randint(1000, 6000))}) + b"\n")
    open(os.path.join(root, "complete"), "w").close()


SOURCES = {
    "web": {"format": "jsonl", "paths": ["web/*.jsonl"], "text_key": "text", "tokenizer": "byte"},
    "code": {"format": "megatron", "paths": ["code/code_text_document"]},
    "books": {"format": "jsonl", "paths": ["books/*.jsonl"], "text_key": "body", "tokenizer": "byte"},
}
