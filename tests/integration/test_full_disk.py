"""A full disk under the state dir (a real, small tmpfs mounted by the test): the coordinator
says so, sends nothing it has not journaled, waits, and carries on once there is space; the
stream is the fault-free one and the journal is intact."""

import os
import subprocess
import threading

import pytest

from coordinator.journal import JournalFile
from msd_common.spec import load_job
from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job

from .harness import run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 40
FULL_S = 4.0


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: str) -> str:
    """Write a file until the disk is full; returns its path."""
    path = os.path.join(directory, "filler")
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
        except OSError:
            pass
    return path


def test_a_full_state_dir_disk_holds_the_job_back_and_loses_nothing(dataset_dir, small_disk, tmp_path):
    path = write_job(dataset_dir, job_dict(runtime={"heartbeat_s": 0.5, "prepare_batch": 16, "lookahead_steps": 3}),
                     "disk.yaml")
    clean = run_job(path, workers=2, ranks=2, steps=STEPS)
    state = os.path.join(small_disk, "state")
    filled = []

    def fill_then_free(cluster, n_batches):
        if n_batches >= 20 and not filled:
            filled.append(_fill(small_disk))
            threading.Timer(FULL_S, os.unlink, (filled[0],)).start()

    log = str(tmp_path / "disk.log")
    with LocalJob(path, workers=2, log_path=log, log_level="INFO", state_dir=state) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=STEPS, during=fill_then_free, timeout_s=120, compute_s=0.01)
    assert filled
    assert signature(received) == signature(clean)
    text = open(log).read()
    assert "nothing more goes out until it succeeds" in text and "writable again after" in text
    assert "stopping the coordinator" not in text
    states = JournalFile(state, load_job(path).digest()).load()  # every line whole (it raises on a torn one)
    assert [s["next_step"] for s in states] == sorted({s["next_step"] for s in states})
    assert max(s["next_step"] for s in states) >= STEPS
