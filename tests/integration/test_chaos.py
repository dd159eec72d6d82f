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


class WorkerKiller:
    """SIGKILLs a random worker process of the job every `low`-`high` seconds (seeded)."""

    def __init__(self, seed: int, low: float = 0.5, high: float = 2.0) -> None:
        self.rng, self.low, self.high = random.Random(seed), low, high
        self.kills: list[int] = []
        self.next_at = time.monotonic() + 1.0

    def __call__(self, cluster) -> None:
        now = time.monotonic()
        if now >= self.next_at:
            pids = cluster.worker_pids()
            if pids:
                victim = self.rng.choice(pids)
                os.kill(victim, signal.SIGKILL)
                self.kills.append(victim)
            self.next_at = now + self.rng.uniform(self.low, self.high)


def test_random_worker_kills_through_300_steps(dataset_dir, tmp_path):
    path = write_job(dataset_dir, job_dict(runtime={"heartbeat_s": 0.3}), "chaos.yaml")
    clean = run_job(path, workers=3, ranks=2, steps=STEPS, timeout_s=180)
    killer = WorkerKiller(7)
    kills = killer.kills

    def chaos(cluster, n_batches):
        killer(cluster)

    log = os.environ.get("MSD_CHAOS_LOG") or str(tmp_path / "chaos.log")
    # 600 micro-batches of 25 ms: the run lasts 15 s at least however fast the loader, and a kill
    # comes every 0.5-2 s, so at least 8 of them land inside it
    faulty = run_job(path, workers=3, ranks=2, steps=STEPS, during=chaos, log_path=log, timeout_s=300,
                     compute_s=0.025)
    assert len(kills) >= 5, kills
    assert signature(faulty) == signature(clean)  # no lost, duplicated or reordered piece
    assert check_content(path, faulty) > 1000
    with open(log) as f:
        assert f.read().count("declared dead") >= 3


def test_a_real_runs_life_in_one_run_of_300_steps(dataset_dir, tmp_path):
    """Everything at once: poison records in two formats (corrupt JSON lines, a decompression
    bomb and an undecodable image in a WebDataset shard), worker SIGKILLs at random, every rank
    pausing, one rank three times slower for 50 steps, and the primary coordinator SIGKILLed with
    a standby taking over. The stream equals a fault-free run's, the poison skipped in both."""
    from msd.testing.local import LocalJob
    from msd.testing.multimodal_data import write_webdataset

    from .harness import run_ranks

    os.makedirs(f"{dataset_dir}/chaos-img", exist_ok=True)
    write_webdataset(f"{dataset_dir}/chaos-img/shard-0.tar", 40, seed=9, sizes=(32, 80),
                     broken={7: "bomb", 21: "bad_image"})
    job = job_dict(runtime={"heartbeat_s": 0.3, "prepare_batch": 16, "lookahead_steps": 3})
    job["sources"]["images"] = {"format": "webdataset", "paths": ["chaos-img/*.tar"], "image_token_id": 300,
                                "max_pixels": 32 * 32, "patch_size": 16}
    job["mixture"] = {"weights": {"web": 0.4, "code": 0.3, "long": 0.15, "images": 0.15}}
    path = write_job(dataset_dir, job, "life.yaml")
    clean = run_job(path, workers=3, ranks=2, steps=STEPS, timeout_s=240)

    killer = WorkerKiller(11, high=2.5)
    kills, primary_killed = killer.kills, []

    def chaos(cluster, n_batches):
        killer(cluster)
        if n_batches >= 4 * 220 and not primary_killed:  # 2 ranks x 2 micro-batches a step: about step 220
            cluster.coordinator.kill()
            primary_killed.append(time.monotonic())

    # seconds per micro-batch (2 a step): every rank stops for 3 s after step 100; rank 1 is 3x
    # slower for steps 150-199. The run lasts 13 s at least however fast the loader, so that at
    # least 5 kills (one every 0.5-2.5 s) land inside it
    pause_and_slow = {0: [(0, 0.015), (100, 1.5), (101, 0.015)],
                      1: [(0, 0.015), (100, 1.5), (101, 0.015), (150, 0.045), (200, 0.015)]}
    log = str(tmp_path / "life.log")
    with LocalJob(path, workers=3, log_path=log, log_level="INFO", state_dir=str(tmp_path / "state"),
                  standby=True) as cluster:
        faulty, _ = run_ranks(cluster, ranks=2, steps=STEPS, during=chaos, timeout_s=300, compute_s=pause_and_slow)
    assert len(kills) >= 5 and primary_killed
    assert signature(faulty) == signature(clean)
    assert check_content(path, faulty) > 1000
    text = open(log).read()
    assert "over max_image_pixels" in text and "does not decode" in text and "corrupt JSON line" in text
    assert "with token 2" in text  # the standby served the end of the run
