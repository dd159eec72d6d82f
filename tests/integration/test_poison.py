"""Poison records among good ones, through real processes: a decompression bomb in a WebDataset
shard is skipped before it is decoded; a record whose reading kills the worker process is tried
on three workers, then quarantined, journaled, and skipped the same way by a restarted coordinator."""

import os

import numpy as np
import orjson
import pytest

from msd.testing.local import LocalJob
from msd.testing.multimodal_data import write_webdataset
from tests.conftest import write_job
from msd_common.doc_keys import split_doc_key
from worker.core import KILL_RECORDS_ENV

from .harness import check_content, run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BOMB = 37  # the sample of the shard whose header declares 200 million pixels


def _records(received) -> set[tuple[int, int]]:
    return {split_doc_key(k) for batches in received.values() for b in batches for k in b["doc_keys"].tolist()}


def _records_of(received, source: int) -> set[int]:
    return {r for s, r in _records(received) if s == source}


def test_a_decompression_bomb_among_good_samples_is_skipped(tmp_path):
    # As reported: one image whose header declares 200 million pixels among 60 good samples
    # stopped the job for good (Pillow's DecompressionBombError killed the worker, again and again).
    (tmp_path / "img").mkdir()
    write_webdataset(str(tmp_path / "img" / "shard-0.tar"), 61, seed=3, sizes=(32, 96), broken={BOMB: "bomb"})
    job = {
        "seed": 5,
        "sources": {"images": {"format": "webdataset", "paths": ["img/*.tar"], "image_token_id": 300,
                               "max_pixels": 32 * 32, "patch_size": 16}},
        "batch": {"seq_len": 256, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"images": 1.0}},
        "runtime": {"heartbeat_s": 0.2, "prepare_batch": 8, "lookahead_steps": 2},
    }
    path = write_job(str(tmp_path), job)
    log = str(tmp_path / "job.log")
    received = run_job(path, workers=2, ranks=2, steps=40, log_path=log, timeout_s=120)  # a few epochs
    text = open(log).read()
    # every good sample came through, the bomb never did
    assert _records_of(received, 0) == set(range(61)) - {BOMB}
    assert check_content(path, received) > 0
    assert f"sample '{BOMB:06d}'" in text and "over max_image_pixels" in text, "the skip names the sample and why"
    assert "exited with" not in text, "no worker process died"


def _text_job(tmp_path, n: int = 120) -> str:
    rng = np.random.default_rng(0)
    (tmp_path / "text").mkdir(exist_ok=True)
    with open(tmp_path / "text" / "t.jsonl", "wb") as f:
        for i in range(n):
            f.write(orjson.dumps({"text": f"record {i} " + "word " * int(rng.integers(5, 120))}) + b"\n")
    job = {
        "seed": 11,
        "sources": {"text": {"format": "jsonl", "paths": ["text/*.jsonl"]}},
        "batch": {"seq_len": 256, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"text": 1.0}},
        "runtime": {"heartbeat_s": 0.2, "prepare_batch": 16, "lookahead_steps": 2},
    }
    return write_job(str(tmp_path), job)


def test_a_record_that_kills_workers_is_quarantined_and_journaled(tmp_path, monkeypatch):
    path = _text_job(tmp_path)
    state = str(tmp_path / "state")
    poison = 17
    steps = 40  # more records than the source has: the poison record is needed
    monkeypatch.setenv(KILL_RECORDS_ENV, f"text:{poison}")
    log = str(tmp_path / "first.log")
    with LocalJob(path, workers=2, log_path=log, log_level="INFO", state_dir=state) as cluster:
        first, _ = run_ranks(cluster, ranks=2, steps=steps, timeout_s=150)
    text = open(log).read()
    assert poison not in _records_of(first, 0)
    assert _records_of(first, 0) == set(range(120)) - {poison}, "every other record came through"
    assert check_content(path, first) > 0
    # the first try and two retries, each on another worker process; then never again
    assert text.count(f"{KILL_RECORDS_ENV} names this record") == 3
    assert f"record {poison} quarantined" in text
    with open(os.path.join(state, "quarantine.journal"), "rb") as f:
        entries = [orjson.loads(line) for line in f.read().splitlines()]
    assert [(e["source"], e["record"]) for e in entries] == [("text", poison)]

    # A restarted coordinator on the same state dir, trainers starting over from step 0: the same
    # stream, with the record skipped without any worker dying (the kill switch is off).
    monkeypatch.delenv(KILL_RECORDS_ENV)
    log2 = str(tmp_path / "second.log")
    with LocalJob(path, workers=2, log_path=log2, log_level="INFO", state_dir=state) as cluster:
        second, _ = run_ranks(cluster, ranks=2, steps=steps, timeout_s=150)
    assert signature(second) == signature(first)
    assert "exited with" not in open(log2).read()
