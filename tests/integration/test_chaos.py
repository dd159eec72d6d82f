"""Chaos: worker processes SIGKILLed at random moments every couple of seconds through a run of
300 steps; the delivered stream must equal a fault-free run's, piece by piece."""

import os
import random
import signal
import time

import pytest

from tests.conftest import job_dict, write_job

from .harness import check_content, run_job, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

STEPS = 300


def test_random_worker_kills_through_300_steps(dataset_dir, tmp_path):
    path = write_job(dataset_dir, job_dict(runtime={"heartbeat_s": 0.3}), "chaos.yaml")
    clean = run_job(path, workers=3, ranks=2, steps=STEPS, timeout_s=180)
    rng = random.Random(7)
    kills, next_kill = [], [time.monotonic() + 1.0]

    def chaos(cluster, n_batches):
        now = time.monotonic()
        if now >= next_kill[0]:
            pids = cluster.worker_pids()
            if pids:
                victim = rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                kills.append(victim)
            next_kill[0] = now + rng.uniform(0.5, 2.0)

    log = os.environ.get("MSD_CHAOS_LOG") or str(tmp_path / "chaos.log")
    faulty = run_job(path, workers=3, ranks=2, steps=STEPS, during=chaos, log_path=log, timeout_s=300,
                     compute_s=0.01)
    assert len(kills) >= 5, kills
    assert signature(faulty) == signature(clean)  # no lost, duplicated or reordered piece
    assert check_content(path, faulty) > 1000
    with open(log) as f:
        assert f.read().count("declared dead") >= 3
