"""The stream of the shipped job files, pinned: their plan digests and the first steps' batches, token
for token (which records, which pieces, which ranks, the tokens and masks each piece holds).

A change of code that is not meant to change the stream (a refactor, a speed-up) must leave these
equal; a change that is meant to must say so in CHANGELOG.md and update the pinned values. The
digest is also what a state directory is keyed by: a coordinator of new code resumes an old one
only while it is unchanged."""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import orjson
import pytest

from msd_common.spec import load_job
from msd.replay import fresh_plan, manifest_of

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
STEPS = 6

# (the job's digest, the same in every checkout since 0.4.0; the digest 0.3.0 gave it, with the
# checkout's path taken out, which JobConfig.digest_before_0_4 must still give for old state dirs and
# checkpoints; sha256 of the first STEPS steps' manifests and of the tokens and masks of every piece)
PINNED = {
    "example.yaml": ("b9ffae8531f2fe50", "1c5f1269a4b14713",
                     "66b8eabbe64c33bbbe5788ac353345e700bab56e0cca0cff2caad3199179996f"),
    "sft.yaml": ("79874821a8d68530", "34a29348e94eee3c",
                 "b63e5b495b1a66ea125f67f260ceb3d50eba20fcfc6a92968ca09f9d792d9333"),
}


def digest_before_0_4(job) -> str:
    """job.digest_before_0_4() as it would be with the configs folder at one fixed path (it holds
    absolute paths of shards and tokenizers, so it differs between checkouts)."""
    definition = job.stream_definition(where=True)
    text = orjson.dumps(definition, option=orjson.OPT_SORT_KEYS).decode()
    text = text.replace(os.path.abspath(CONFIGS), "CONFIGS")
    assert job.digest_before_0_4() == hashlib.sha256(orjson.dumps(definition,
                                                                  option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def stream_hash(job, steps: int) -> str:
    planner, known = fresh_plan(job)
    h = hashlib.sha256()
    for _ in range(steps):
        plan = planner.plan_step(known)
        manifest = manifest_of(plan, job, known)
        h.update(repr(manifest).encode())
        for rank in manifest["ranks"].values():
            for piece in rank:
                s = next(src.index for src in job.sources if src.name == piece["source"])
                epoch = known._epochs(s, np.array([piece["position"]]))[0]
                tokens, patches, mask = known.reader(s).read_full(piece["record"], epoch)
                part = slice(piece["offset"], piece["offset"] + piece["length"])
                h.update(np.ascontiguousarray(tokens[part], dtype=np.int64).tobytes())
                if mask is not None:
                    h.update(np.ascontiguousarray(mask[part], dtype=np.uint8).tobytes())
                if patches is not None:
                    h.update(np.ascontiguousarray(patches).tobytes())
    return h.hexdigest()


@pytest.mark.parametrize("name", sorted(PINNED))
def test_the_shipped_jobs_keep_their_digest_and_stream(name, monkeypatch):
    monkeypatch.syspath_prepend(CONFIGS)  # sft.yaml's transform module, as its comment says
    job = load_job(os.path.join(CONFIGS, name))
    assert (job.digest(), digest_before_0_4(job), stream_hash(job, STEPS)) == PINNED[name]


if __name__ == "__main__":  # print the values to pin
    sys.path.insert(0, CONFIGS)
    for name in sorted(PINNED):
        job = load_job(os.path.join(CONFIGS, name))
        print(f'    "{name}": ("{job.digest()}", "{digest_before_0_4(job)}", "{stream_hash(job, STEPS)}"),')
