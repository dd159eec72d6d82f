"""tools/train_tiny.py, the training script people copy: a small transformer trained with DDP over 2
processes (gloo) from DataClient. 20 steps in one go, and 10 + 10 with a checkpoint and fresh
trainer processes (and a fresh coordinator with no state dir: the checkpoint carries its state) in
between: the per-step losses are equal bit for bit, and the loss falls."""

import json
import os
import subprocess
import sys

import pytest

from msd.testing.local import LocalJob
from msd.testing.ports import free_port
from tests.conftest import job_dict, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train(job_path: str, steps: int, tmp_path, name: str, save=None, resume=None) -> list:
    losses = str(tmp_path / f"{name}.json")
    args = [sys.executable, os.path.join(ROOT, "tools", "train_tiny.py"), "--steps", str(steps), "--losses", losses,
            "--port", str(free_port())]
    args += ["--save", save] if save else []
    args += ["--resume", resume] if resume else []
    with LocalJob(job_path, workers=2) as job:
        done = subprocess.run(args + ["--coordinator", job.address], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    with open(losses) as f:
        return [tuple(x) for x in json.load(f)]


def test_train_tiny_resumes_bit_for_bit_and_learns(dataset_dir, tmp_path):
    job = job_dict(batch={"seq_len": 128, "micro_batch_size": 1, "global_batch_size": 4})  # 2 micro-batches a rank
    path = write_job(dataset_dir, job, "tiny.yaml")
    whole = _train(path, 20, tmp_path, "whole")
    ckpt = str(tmp_path / "ckpt")
    first = _train(path, 10, tmp_path, "first", save=ckpt)
    second = _train(path, 20, tmp_path, "second", resume=ckpt)
    assert [s for s, _ in whole] == list(range(20))
    assert first + second == whole  # floats compared exactly
    early, late = sum(v for _, v in whole[:3]) / 3, sum(v for _, v in whole[-3:]) / 3
    assert late < early * 0.9, whole
