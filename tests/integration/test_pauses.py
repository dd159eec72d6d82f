"""A training run's normal life, with real processes: every rank stops reading for a while (a
checkpoint save), one rank pauses alone, one rank is slower for a stretch, a trainer process is
frozen. Deadlines are short (heartbeat 0.2 s: a peer is dead after 0.6 s of silence) and every
pause is many times longer: nothing is declared dead, nothing is prepared again, and the stream
is the fault-free one."""

import os
import signal
import threading

import pytest

from tests.conftest import job_dict, write_job

from .harness import run_job, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 30
PAUSE_S = 5.0  # > 8 x every deadline involved (3 heartbeats of 0.2 s)
RECOVERY_WORDS = ("declared dead", "silent for", "re-preparing")


@pytest.fixture(scope="module")
def paused_job(dataset_dir):
    job = job_dict(runtime={"heartbeat_s": 0.2, "prepare_batch": 16, "lookahead_steps": 3})
    job["batch"] = {"seq_len": 512, "micro_batch_size": 2, "global_batch_size": 4}  # 1 micro-batch per rank
    path = write_job(dataset_dir, job, "paused.yaml")
    return path, run_job(path, workers=2, ranks=2, steps=STEPS)


def _no_recovery(log: str) -> None:
    text = open(log).read()
    for words in RECOVERY_WORDS:
        assert words not in text, f"{words!r} in the log: a pause was taken for a failure"


def _gap(batches: list[dict], step: int) -> float:
    """Seconds between receiving the last micro-batch of `step` and the first of the next."""
    at = {b["step"]: b["received_at"] for b in batches}
    return at[step + 1] - at[step]


def test_every_rank_pausing_many_deadlines_long_changes_nothing(paused_job, tmp_path):
    path, clean = paused_job
    log = str(tmp_path / "pause.log")
    pause = [(0, 0.0), (10, PAUSE_S), (11, 0.0)]  # after receiving step 10, each rank stops reading
    paused = run_job(path, workers=2, ranks=2, steps=STEPS, compute_s=pause, log_path=log, timeout_s=120)
    assert signature(paused) == signature(clean)
    _no_recovery(log)
    for rank in (0, 1):  # the step after the pause was prefetched: it is there at once
        assert PAUSE_S <= _gap(paused[rank], 10) < PAUSE_S + 0.5


def test_one_rank_pausing_alone_changes_nothing_for_it_or_the_others(paused_job, tmp_path):
    path, clean = paused_job
    log = str(tmp_path / "one.log")
    paused = run_job(path, workers=2, ranks=2, steps=STEPS, compute_s={0: 0.0, 1: [(0, 0.0), (8, PAUSE_S), (9, 0.0)]},
                     log_path=log, timeout_s=120)
    assert signature(paused) == signature(clean)
    _no_recovery(log)
    assert PAUSE_S <= _gap(paused[1], 8) < PAUSE_S + 0.5


def test_a_rank_three_times_slower_for_a_stretch_changes_nothing(paused_job, tmp_path):
    path, clean = paused_job
    log = str(tmp_path / "slow.log")
    slow = run_job(path, workers=2, ranks=2, steps=STEPS,
                   compute_s={0: 0.02, 1: [(0, 0.02), (5, 0.06), (25, 0.02)]}, log_path=log, timeout_s=120)
    assert signature(slow) == signature(clean)
    _no_recovery(log)


def test_a_frozen_trainer_process_never_makes_a_worker_look_dead(paused_job, tmp_path):
    """SIGSTOP freezes the client's I/O thread too: its socket fills, its heartbeats stop. The
    workers' sends must not block (their heartbeats would stop as well); the rank is released
    and, thawed, registers again and gets the same stream."""
    path, clean = paused_job
    frozen = []

    def freeze(cluster, n_batches):
        if n_batches >= 16 and not frozen:
            pid = cluster.trainer_pids[1]
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
            threading.Timer(PAUSE_S, os.kill, (pid, signal.SIGCONT)).start()

    log = str(tmp_path / "frozen.log")
    thawed = run_job(path, workers=2, ranks=2, steps=STEPS, during=freeze, compute_s=0.02, log_path=log,
                     timeout_s=120)
    assert frozen
    assert signature(thawed) == signature(clean)
    text = open(log).read()
    assert "rank 1 silent" in text, "the frozen rank was noticed"
    assert "worker" not in "".join(line for line in text.splitlines() if "declared dead" in line)


def test_a_worker_busy_reading_for_many_deadlines_is_not_taken_for_dead(paused_job, tmp_path, monkeypatch):
    """One prepare task can take longer than three heartbeats (slow records, hundreds of sources
    opened with a cold page cache): the worker's core keeps it alive from inside the work, so
    nothing is declared dead or prepared again, and the stream is the clean one."""
    path, clean = paused_job
    # every early record of `web` takes 0.3 s to read: a task of a few of them takes longer than
    # the 0.6 s after which a silent worker is declared dead
    monkeypatch.setenv("MSD_TEST_SLOW_RECORDS", ",".join(f"web:{r}=0.3" for r in range(40)))
    log = str(tmp_path / "busy.log")
    busy = run_job(path, workers=2, ranks=2, steps=STEPS, log_path=log, timeout_s=120)
    assert signature(busy) == signature(clean)
    _no_recovery(log)
