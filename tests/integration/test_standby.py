"""A standby coordinator on the same state dir (`msd coordinator --standby`), with real processes:
the primary is SIGKILLed mid-run and the standby takes over from the journal; a primary frozen
past its lease comes back, finds another holder, and stops without a word to the peers. Workers
and clients are given both addresses and move on their own; the stream is the fault-free one."""

import datetime
import os
import re
import signal
import threading
import time

import pytest

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job

from .harness import run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 60
HEARTBEAT_S = 0.3


@pytest.fixture(scope="module")
def standby_job(dataset_dir):
    path = write_job(dataset_dir, job_dict(runtime={"heartbeat_s": HEARTBEAT_S, "prepare_batch": 16,
                                                    "lookahead_steps": 3}), "standby.yaml")
    return path, run_job(path, workers=2, ranks=2, steps=STEPS)


def _logged_at(text: str, words: str) -> float:
    """Wall-clock time of the first log line holding `words`."""
    line = next(line for line in text.splitlines() if words in line)
    stamp = re.match(r"(\S+ \S+)", line).group(1)
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_the_standby_takes_over_from_a_killed_primary_and_the_stream_holds(standby_job, tmp_path):
    path, clean = standby_job
    killed = []

    def kill_primary(cluster, n_batches):
        if n_batches >= 40 and not killed:
            cluster.coordinator.kill()
            killed.append(time.time())

    log = str(tmp_path / "takeover.log")
    with LocalJob(path, workers=2, log_path=log, log_level="INFO", state_dir=str(tmp_path / "state"),
                  standby=True) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=STEPS, during=kill_primary, timeout_s=120, compute_s=0.01)
    assert killed
    assert signature(received) == signature(clean)
    text = open(log).read()
    assert "was not renewed" in text and "with token 2" in text
    took_over = _logged_at(text, "with token 2") - killed[0]
    serving = _logged_at(text.split("with token 2", 1)[1], "listening on") - killed[0]
    stall = max(_longest_wait(batches, killed[0]) for batches in received.values())
    print(f"takeover: lease taken {took_over:.2f}s after the kill, standby serving after {serving:.2f}s, longest "
          f"wait for a batch after the kill {stall:.2f}s (heartbeat {HEARTBEAT_S}s, compute 0.01s per micro-batch)")
    assert took_over < 3 * HEARTBEAT_S + 1.0  # the standby notices within 3 heartbeats (plus its polling)
    assert stall < 10 * HEARTBEAT_S + 3.0


def _longest_wait(batches: list[dict], since: float) -> float:
    at = sorted(b["received_at"] for b in batches)
    return max((b - a for a, b in zip(at, at[1:]) if b > since), default=0.0)


def test_a_primary_frozen_past_its_lease_comes_back_and_stops(standby_job, tmp_path):
    path, clean = standby_job
    frozen = []

    def freeze_primary(cluster, n_batches):
        if n_batches >= 40 and not frozen:
            pid = cluster.coordinator.pid
            os.kill(pid, signal.SIGSTOP)
            frozen.append(pid)
            threading.Timer(8 * HEARTBEAT_S, os.kill, (pid, signal.SIGCONT)).start()

    log = str(tmp_path / "fenced.log")
    with LocalJob(path, workers=2, log_path=log, log_level="INFO", state_dir=str(tmp_path / "state"),
                  standby=True) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=STEPS, during=freeze_primary, timeout_s=120,
                                compute_s=0.01)
        cluster.coordinator.join(15)
        assert cluster.coordinator.exitcode == 1, "the old primary stopped by itself, failing"
    assert frozen
    assert signature(received) == signature(clean)
    text = open(log).read()
    assert "another coordinator serves this job now" in text


def test_a_primary_that_finds_another_token_at_a_journal_write_stops_without_a_word(dataset_dir, tmp_path):
    """The fenced primary may learn of the new holder at a journal write rather than at its next
    renewal (a frozen primary resumes with steps to journal): it stops as when renewing, with the
    same words, and tells the peers nothing (they are the new holder's). Before, it told them
    "coordinator stopping" as in a clean stop. A long heartbeat makes the journal write come first."""
    from coordinator.lease import LEASE, LeaseRecord, read_lease

    path = write_job(dataset_dir, job_dict(runtime={"heartbeat_s": 5.0, "prepare_batch": 16, "lookahead_steps": 3}),
                     "fenced-at-write.yaml")
    state, log = str(tmp_path / "state"), str(tmp_path / "job.log")
    stolen = []

    def take_the_lease(cluster, n_batches):  # as a standby taking over writes its record
        if n_batches >= 20 and not stolen:
            held = read_lease(state)
            new = LeaseRecord(holder="standby-elsewhere", token=held.token + 1, address="tcp://10.0.0.2:5555", beat=0)
            fd = os.open(os.path.join(state, LEASE), os.O_WRONLY)
            try:
                os.pwrite(fd, new.encode(), 0)
            finally:
                os.close(fd)
            stolen.append(time.monotonic())

    with LocalJob(path, workers=1, log_path=log, log_level="INFO", state_dir=state) as cluster:
        try:  # the ranks are left waiting for a coordinator (the new holder is not really there)
            run_ranks(cluster, ranks=2, steps=STEPS, during=take_the_lease, timeout_s=15)
        except AssertionError:
            pass
        cluster.coordinator.join(15)
        assert cluster.coordinator.exitcode == 1, "the fenced primary stopped, failing"
    assert stolen
    text = open(log).read()
    assert "another coordinator serves this job now" in text, text[-3000:]
    assert "token" in text.split("another coordinator serves this job now")[0].splitlines()[-1]
    assert "coordinator asked us to stop" not in text, "the fenced primary told the new holder's peers to stop"
