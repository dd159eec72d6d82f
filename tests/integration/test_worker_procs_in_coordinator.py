"""`msd coordinator --worker-procs N`: a job on one machine from one command. The coordinator's
process forks the host's fork server before it opens anything and runs the host agent's loop in a
thread; the stream is the one a separate `msd worker` host gives, a killed worker process is
forked again, and nothing is left behind when the coordinator stops or dies."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from types import SimpleNamespace

import pytest

from msd.testing.local import LocalJob
from msd.testing.ports import free_address
from msd.testing.processes import msd_command, wait_gone
from tests.conftest import job_dict, write_job
from tests.integration.harness import check_content, run_ranks, signature
from worker.forks import SERVER_NAME, WORKER_NAME, fork_server_pids, host_worker_pids, process_comm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS, RANKS = 6, 2



def _start(job: str, address: str, *args: str, log: str) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen([msd_command(), "coordinator", "--config", job, "--bind", address,
                                 "--log-level", "INFO", *args], stderr=f)


def _wait_workers(coordinator: subprocess.Popen, n: int, log: str, timeout_s: float = 60) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(host_worker_pids(coordinator.pid)) < n:
        assert coordinator.poll() is None, open(log).read()
        assert time.monotonic() < deadline, f"no {n} worker processes: {open(log).read()}"
        time.sleep(0.1)
    return host_worker_pids(coordinator.pid)



def test_one_command_serves_the_stream_of_a_separate_host_and_forks_a_killed_worker_again(dataset_dir, tmp_path):
    job = write_job(dataset_dir, job_dict(), f"job-in-coordinator-{os.getpid()}.yaml")
    with LocalJob(job, workers=2) as separate:
        expected, _ = run_ranks(separate, ranks=RANKS, steps=STEPS)

    address, log = free_address(), str(tmp_path / "coordinator.log")
    coordinator = _start(job, address, "--worker-procs", "2", log=log)
    try:
        workers = _wait_workers(coordinator, 2, log)
        # the host's processes are the coordinator's: its fork server and the workers under it
        servers = fork_server_pids(coordinator.pid)
        assert len(servers) == 1 and [process_comm(p) for p in workers] == [WORKER_NAME, WORKER_NAME]

        def kill_one(cluster, batches: int) -> None:  # a worker process dies mid-job
            if batches == 3:
                os.kill(workers[0], signal.SIGKILL)

        got, _ = run_ranks(SimpleNamespace(address=address), ranks=RANKS, steps=STEPS, during=kill_one)
        assert signature(got) == signature(expected)
        assert check_content(job, got) > 0
        deadline = time.monotonic() + 30
        while not (len(host_worker_pids(coordinator.pid)) == 2 and workers[0] not in host_worker_pids(coordinator.pid)):
            assert time.monotonic() < deadline, "the killed worker process was not forked again"
            time.sleep(0.1)
        after = host_worker_pids(coordinator.pid)
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(60) == 0, open(log).read()
        wait_gone([*servers, *after], timeout_s=20)  # the coordinator stops its host's processes as it stops
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    text = open(log).read()
    assert "worker process" in text and "exited with -9" in text, text  # the host's log is the coordinator's


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_a_clean_stop_says_nothing_alarming(dataset_dir, tmp_path, how):
    """Issue 61, tried as a new user would: Ctrl-C on `msd coordinator --worker-procs 2` logged
    "worker process ... exited with 0; restarting" for each worker and "the connection to the
    coordinator broke; registering this host again": warnings that say nothing on a clean stop."""
    job = write_job(dataset_dir, job_dict(), f"job-in-coordinator-stop-{os.getpid()}.yaml")
    log = str(tmp_path / "coordinator.log")
    with open(log, "wb") as f:
        coordinator = subprocess.Popen([msd_command(), "coordinator", "--config", job, "--bind", free_address(),
                                        "--log-level", "INFO", "--worker-procs", "2"], stderr=f,
                                       start_new_session=True)  # its own process group, as a terminal's job
    try:
        workers = _wait_workers(coordinator, 2, log)
        servers = fork_server_pids(coordinator.pid)
        time.sleep(1.0)  # registered with the coordinator
        if how == "ctrl-c":  # the terminal sends SIGINT to every process of the foreground group
            os.killpg(coordinator.pid, signal.SIGINT)
        else:
            coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(60)
        wait_gone([*servers, *workers], timeout_s=20)
    finally:
        if coordinator.poll() is None:
            coordinator.kill()
    text = open(log).read()
    assert "Traceback" not in text, text
    warnings = [line for line in text.splitlines() if " WARNING " in line or " ERROR " in line]
    assert not [w for w in warnings if "restarting" in w or "registering this host again" in w], text


def test_a_killed_coordinator_leaves_no_worker_process_behind(dataset_dir, tmp_path):
    job = write_job(dataset_dir, job_dict(), f"job-in-coordinator-kill-{os.getpid()}.yaml")
    log = str(tmp_path / "coordinator.log")
    coordinator = _start(job, free_address(), "--worker-procs", "auto", "--max-worker-procs", "2", log=log)
    try:
        workers = _wait_workers(coordinator, 1, log)
        servers = fork_server_pids(coordinator.pid)
    finally:
        coordinator.kill()
        coordinator.wait(10)
    # the server sees the coordinator's pipe close; the workers see their parent go
    wait_gone([*servers, *workers], timeout_s=20)


def test_a_bad_job_file_stops_the_coordinator_and_its_fork_server(tmp_path):
    bad = write_job(str(tmp_path), {**job_dict(), "batch": {"seq_len": "long"}}, "bad.yaml")
    result = subprocess.run([msd_command(), "coordinator", "--config", bad, "--bind", free_address(),
                             "--worker-procs", "1"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert "batch.seq_len" in result.stderr and "invalid job file" in result.stderr
    leftovers = [p for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                 if process_comm(p) == SERVER_NAME and bad in _cmdline(p)]
    assert not leftovers


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("args, message", [
    (["--worker-procs", "0"], "expected a number >= 1 or 'auto'"),
    (["--worker-procs", "two"], "expected a number >= 1 or 'auto'"),
    (["--worker-procs", "2", "--max-worker-procs", "4"], "only with --worker-procs auto"),
    (["--max-worker-procs", "4"], "only with --worker-procs auto"),
    (["--worker-procs", "1", "--standby", "--state-dir", "STATE"], "a standby runs no workers of its own"),
    (["--worker-procs", "1", "--bind", "tcp://127.0.0.1:0"], "needs a fixed port"),
])
def test_bad_worker_procs_options_are_named(tmp_path, args, message):
    job = write_job(str(tmp_path), job_dict(), "job.yaml")
    args = [str(tmp_path / "state") if a == "STATE" else a for a in args]
    result = subprocess.run([msd_command(), "coordinator", "--config", job, "--bind", free_address(), *args],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr


def test_with_index_on_workers_the_coordinators_own_workers_index_and_count(tmp_path):
    """runtime.index_on: workers with the workers in the coordinator's process: the coordinator
    waits for workers to count the sources, and its own host's workers (started before it
    listens) do it; the stream is the one of the coordinator indexing itself."""
    from tests.conftest import build_dataset

    root = str(tmp_path / "data")
    build_dataset(root)  # nothing indexed yet
    runtime = {**job_dict()["runtime"], "index_on": "workers"}
    job = write_job(root, job_dict(runtime=runtime), "job.yaml")
    address, log = free_address(), str(tmp_path / "coordinator.log")
    coordinator = _start(job, address, "--worker-procs", "2", log=log)
    try:
        got, _ = run_ranks(SimpleNamespace(address=address), ranks=RANKS, steps=STEPS, timeout_s=120)
    finally:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(60)
    assert "workers counted 2 source(s)" in open(log).read()
    reference = write_job(root, job_dict(), "reference.yaml")  # the indexes now exist: the coordinator reads them
    with LocalJob(reference, workers=1) as separate:
        expected, _ = run_ranks(separate, ranks=RANKS, steps=STEPS)
    assert signature(got) == signature(expected)
    assert check_content(job, got) > 0
