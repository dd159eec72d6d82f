"""The whole path with real processes and sockets: coordinator, worker processes, trainer ranks."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from tests.conftest import job_dict, write_job
from msd_common.doc_keys import split_doc_key

from .harness import check_content, run_job, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 25


@pytest.fixture(scope="module")
def job_path(dataset_dir):
    return write_job(dataset_dir, job_dict(), "e2e.yaml")


@pytest.fixture(scope="module")
def reference(job_path, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "one-worker.log")
    return run_job(job_path, workers=1, ranks=2, steps=STEPS, log_path=log), log


def test_every_piece_holds_its_documents_tokens(job_path, reference):
    received, _ = reference
    assert all(len(b) == STEPS * 2 for b in received.values())  # 2 micro-batches per step per rank
    assert check_content(job_path, received) > 100
    for batches in received.values():
        for b in batches:
            assert b["num_tokens"] == b["tokens"].size  # steps are exactly full: no padding


def test_same_stream_with_three_workers(job_path, reference):
    received, _ = reference
    three = run_job(job_path, workers=3, ranks=2, steps=STEPS)
    assert signature(three) == signature(received)
    check_content(job_path, three)


def test_corrupt_lines_are_skipped_counted_and_logged(reference, dataset_dir):
    received, log = reference
    keys = {k for bs in received.values() for b in bs for k in b["doc_keys"].tolist()}
    bad = {60 + 2, 60 + 4}  # web-1.jsonl lines 3 and 5
    assert not keys & bad
    assert any(split_doc_key(k)[0] == 0 for k in keys)  # web is delivered at all
    text = open(log).read()
    assert "web-1.jsonl:3: corrupt JSON" in text
    assert "web-1.jsonl:5: corrupt JSON" in text and "skipped so far" in text
    assert "worker[" in text and "skipped record: " in text  # the worker's own log line, same file


def test_worker_killed_mid_run_does_not_change_the_stream(job_path, reference, tmp_path):
    received, _ = reference
    killed = []

    def kill_one(cluster, n_batches):
        if n_batches >= 20 and not killed:
            pids = cluster.worker_pids()
            if pids:
                os.kill(pids[0], signal.SIGKILL)
                killed.append(pids[0])

    log = str(tmp_path / "killed.log")
    faulty = run_job(job_path, workers=2, ranks=2, steps=STEPS, during=kill_one, log_path=log, compute_s=0.05)
    assert killed
    assert signature(faulty) == signature(received)
    assert "declared dead" in open(log).read()  # the run outlived the detection: recovery was exercised


def test_hf_tokenized_source_mixed_with_megatron(dataset_dir, tmp_path):
    from tests.conftest import train_tokenizer

    texts = [open(f"{dataset_dir}/web/web-0.jsonl", encoding="utf-8").read()[:20000]]
    job = job_dict()
    job["sources"]["web"]["tokenizer"] = train_tokenizer(str(tmp_path / "tok.json"), texts)
    path = write_job(str(dataset_dir), job, "hf.yaml")
    received = run_job(path, workers=2, ranks=2, steps=8)
    assert check_content(path, received) > 20
    web_pieces = [k for bs in received.values() for b in bs for k in b["doc_keys"].tolist() if split_doc_key(k)[0] == 0]
    assert web_pieces


def test_worker_frozen_past_its_deadline_registers_again_and_the_stream_holds(job_path, tmp_path):
    steps = 200
    clean = run_job(job_path, workers=1, ranks=2, steps=steps)
    frozen = []

    def freeze_one(cluster, n_batches):
        if n_batches >= 40 and not frozen:
            pid = cluster.worker_pids()[0]
            os.kill(pid, signal.SIGSTOP)  # silent for longer than 3 heartbeats (0.5 s each)
            frozen.append(pid)
            threading.Timer(2.5, os.kill, (pid, signal.SIGCONT)).start()

    log = str(tmp_path / "frozen.log")
    # 10 ms of "compute" per micro-batch keeps the run going (>= 4 s) well past the thaw at ~3 s
    faulty = run_job(job_path, workers=2, ranks=2, steps=steps, during=freeze_one, log_path=log, compute_s=0.01)
    assert frozen
    assert signature(faulty) == signature(clean)
    text = open(log).read()
    dead_at = text.index("declared dead")
    assert f"pid {frozen[0]})" in text[dead_at:], "the frozen worker did not register again"


def test_curriculum_slack_and_end_of_stream(dataset_dir, tmp_path):
    """Stages change the mixture and the sequence length mid-run; token slack pads rows; a source
    with on_exhausted: stop ends the stream, and every rank's iterator stops at the same step."""
    job = job_dict(
        mixture=[{"until_step": 6, "weights": {"web": 0.5, "code": 0.5}},
                 {"weights": {"web": 0.3, "code": 0.3, "long": 0.4}, "seq_len": 1024, "ramp_steps": 3}],
        balance={"method": "greedy", "token_slack": 0.5},
    )
    job["sources"]["long"].update(epochs=1, on_exhausted="stop")
    path = write_job(dataset_dir, job, "stages.yaml")
    received = run_job(path, workers=2, ranks=2, steps=1000, log_path=str(tmp_path / "job.log"))
    assert check_content(path, received) > 50
    last = {r: max(b["step"] for b in bs) for r, bs in received.items()}
    assert last[0] == last[1] and 6 < last[0] < 1000  # ended by the exhausted source, on both ranks
    for batches in received.values():
        for b in batches:
            width = 768 if b["step"] < 6 else 1536  # seq_len x (1 + slack)
            assert b["tokens"].shape == (2, width)
            assert b["num_tokens"] == int(b["piece_lengths"].sum()) <= b["tokens"].size
            assert b["piece_lengths"].max() <= (512 if b["step"] < 6 else 1024)
    per_step = {}
    for batches in received.values():
        for b in batches:
            per_step[b["step"]] = per_step.get(b["step"], 0) + b["num_tokens"]
    assert all(per_step[k] == (8 * 512 if k < 6 else 8 * 1024) for k in per_step)  # global tokens fixed
    with open(tmp_path / "job.log") as f:
        assert "exhausted" in f.read()


def test_trainers_resume_from_an_older_checkpoint_and_get_the_same_batches(job_path):
    """All ranks stop at step 12; restarted from a checkpoint of step 5 they receive exactly
    what they received the first time from step 5 on (the coordinator plans those steps again)."""
    from msd.testing.local import LocalJob

    from .harness import run_ranks

    with LocalJob(job_path, workers=2, log_level="INFO") as cluster:
        first, states = run_ranks(cluster, ranks=2, steps=12)
        resume = {r: dict(states[r], next_step=5, next_micro_batch=0) for r in range(2)}
        again, _ = run_ranks(cluster, ranks=2, steps=12, resume=resume)
    want = {r: [b for b in first[r] if b["step"] >= 5] for r in range(2)}
    assert all(len(again[r]) == len(want[r]) == 7 * 2 for r in range(2))
    assert signature(again) == signature(want)
    for r in range(2):
        for a, b in zip(again[r], want[r]):
            np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_coordinator_killed_and_restarted_from_its_state_dir_keeps_the_stream(job_path, tmp_path):
    """SIGKILL the coordinator in the middle of a 300-step run; a new one on the same address and
    --state-dir takes over: workers and ranks register again by themselves and the stream is the
    fault-free one, piece by piece."""
    from msd.testing.local import LocalJob

    from .harness import run_ranks

    steps = 300
    clean = run_job(job_path, workers=2, ranks=2, steps=steps, timeout_s=180)
    killed = []

    def kill_once(cluster, batches):
        if batches >= steps * 2 and not killed:  # half-way: 2 ranks x 2 micro-batches per step
            started = time.time()
            cluster.restart_coordinator()
            killed.append(time.time() - started)

    with LocalJob(job_path, workers=2, log_level="INFO", state_dir=str(tmp_path / "state")) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=steps, during=kill_once, timeout_s=180)
    assert killed
    assert signature(received) == signature(clean)
    # the ranks stalled no longer than the restart plus two heartbeats (1 s each), plus scheduling
    stalls = [b2["received_at"] - b1["received_at"] for bs in received.values() for b1, b2 in zip(bs, bs[1:])]
    assert max(stalls) <= killed[0] + 2 * 1.0 + 1.0, (max(stalls), killed)


def _tokens_per_document(received, steps):
    """step -> {doc_key: tokens of it in the step}, over all ranks (the global batch's content)."""
    out = {}
    for batches in received.values():
        for b in batches:
            if b["step"] in steps:
                per = out.setdefault(b["step"], {})
                for key, n in zip(b["doc_keys"].tolist(), b["piece_lengths"].tolist()):
                    per[key] = per.get(key, 0) + n
    return out


def test_elastic_resume_over_more_ranks_continues_the_global_stream(dataset_dir, job_path, reference, tmp_path):
    """Stop a dp=2 job at step 10; restart it with dp=4 on the same --state-dir: steps 10.. hold
    the same documents as the uninterrupted dp=2 run, now spread over four ranks."""
    from msd.testing.local import LocalJob

    from .harness import run_ranks

    state = str(tmp_path / "state")
    with LocalJob(job_path, workers=1, state_dir=state) as cluster:
        _, states = run_ranks(cluster, ranks=2, steps=10)
    wide = write_job(dataset_dir, job_dict(topology={"dp": 4}), "e2e-dp4.yaml")
    resume = {r: dict(states[0], rank=r, next_step=10, next_micro_batch=0) for r in range(4)}
    with LocalJob(wide, workers=1, state_dir=state, log_path=str(tmp_path / "wide.log"), log_level="INFO") as cluster:
        widened, _ = run_ranks(cluster, ranks=4, steps=16, resume=resume)
    steps = set(range(10, 16))
    assert _tokens_per_document(widened, steps) == _tokens_per_document(reference[0], steps)
    assert all(b["tokens"].shape == (2, 512) for bs in widened.values() for b in bs)  # 1 micro-batch of 2 rows
    assert "elastic resume: topology.dp: 2 -> 4" in open(tmp_path / "wide.log").read()


def test_a_changed_job_is_refused_at_restart_with_what_changed(dataset_dir, tmp_path):
    from coordinator.statedir import JobChanged, check_job_change
    from msd_common.spec import parse_job

    state = str(tmp_path / "state")
    job = parse_job(job_dict(), "job.yaml", base_dir=dataset_dir)
    assert check_job_change(state, job, allow=False) is False
    assert check_job_change(state, parse_job(job_dict(topology={"dp": 4}), "job.yaml", base_dir=dataset_dir),
                            allow=False) is False  # elastic: allowed
    changed = parse_job(job_dict(seed=99, batch={"seq_len": 1024, "micro_batch_size": 2, "global_batch_size": 8}),
                        "job.yaml", base_dir=dataset_dir)
    with pytest.raises(JobChanged) as e:
        check_job_change(state, changed, allow=False)
    assert "seed: 1234 -> 99" in str(e.value) and "batch.seq_len: 512 -> 1024" in str(e.value)
    assert check_job_change(state, changed, allow=True) is True
