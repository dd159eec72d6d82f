"""A transform that fails on most records is a bug, not poison: max_transform_errors consecutive
errors on one source stop the job, naming the source, the record and the last traceback; a
worker host whose copy of the transform differs from the coordinator's does not serve."""

import sys
import time

import pytest

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_consecutive_transform_errors_stop_the_job_with_the_traceback(dataset_dir, tmp_path):
    (tmp_path / "failing_mod.py").write_text("def f(record, ctx):\n    return record['no_such_field']\n")
    sys.path.insert(0, str(tmp_path))
    try:
        job = job_dict()
        job["sources"]["web"].update(transform="failing_mod:f", max_transform_errors=5)
        path = write_job(str(tmp_path), {**job, "sources": {k: {**v, "paths": [f"{dataset_dir}/{v['paths'][0]}"]}
                                                            for k, v in job["sources"].items()}})
        log = str(tmp_path / "job.log")
        with LocalJob(path, workers=1, log_path=log, log_level="INFO") as cluster:
            deadline = time.monotonic() + 60
            while "answering every peer with the reason" not in open(log).read() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert cluster.coordinator.is_alive(), "a failed job's coordinator lingers (runtime.failed_linger_s)"
            cluster.coordinator.terminate()  # SIGTERM ends the lingering
            cluster.coordinator.join(20)
            assert cluster.coordinator.exitcode == 1
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("failing_mod", None)
    text = open(log).read()
    assert "source 'web': 5 consecutive records failed in transform failing_mod:f" in text
    assert "KeyError" in text and "no_such_field" in text and "Traceback" in text


def test_a_transform_sees_each_records_epoch_even_when_epochs_are_prepared_together(tmp_path):
    """A 5-record source read 3 times a step: several epochs of one record are prepared at once,
    each its own sample (ctx.epoch), and the k-th time a record appears it is from epoch k."""
    import orjson

    from tests.integration.harness import run_job

    (tmp_path / "epoch_mod.py").write_text(
        "from worker.transforms import Sample\n"
        "def f(record, ctx):\n"
        "    return Sample([1 + ctx.record, 100 + ctx.epoch, 50 + int(ctx.rng.integers(0, 40))])\n")
    (tmp_path / "five.jsonl").write_bytes(b"".join(orjson.dumps({"text": str(i)}) + b"\n" for i in range(5)))
    job = {"seed": 3, "sources": {"five": {"format": "jsonl", "paths": ["five.jsonl"], "transform": "epoch_mod:f",
                                           "packing": "whole"}},
           "batch": {"seq_len": 24, "micro_batch_size": 1, "global_batch_size": 2}, "topology": {"dp": 1},
           "mixture": {"weights": {"five": 1.0}}, "runtime": {"heartbeat_s": 0.5, "prepare_batch": 4,
                                                              "lookahead_steps": 3}}
    sys.path.insert(0, str(tmp_path))
    try:
        path = write_job(str(tmp_path), job)
        received = run_job(path, workers=2, ranks=1, steps=6, timeout_s=60)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("epoch_mod", None)
    seen: dict[int, list[int]] = {}
    draws: dict[tuple[int, int], int] = {}
    for b in received[0]:
        tokens = b["tokens"].reshape(-1)
        starts = b["cu_seqlens"].tolist()
        for s, e in zip(starts[:-1], starts[1:]):
            piece = tokens[s:e].tolist()
            if len(piece) == 3 and piece[0] in range(1, 6):
                record, epoch = piece[0] - 1, piece[1] - 100
                seen.setdefault(record, []).append(epoch)
                draws[(record, epoch)] = piece[2]
    assert sum(len(v) for v in seen.values()) >= 20
    for record, epochs in seen.items():
        assert epochs == list(range(len(epochs))), (record, epochs)
    assert len(set(draws.values())) > 1  # the randomness differs between records and epochs
