"""The host's fork server (worker/forks.py): real forks, real pipes, real signals."""

from __future__ import annotations

import os
import signal
import time

import pytest

from coordinator.testing.processes import running
from worker.forks import ForkServer, host_worker_pids


def _target(mode: str, cell) -> None:
    """A stand-in worker: marks a task, then ends as `mode` says."""
    cell.value = 41
    if mode == "ok":
        return
    if mode == "exit3":
        raise SystemExit(3)
    if mode == "crash":
        raise RuntimeError("a bug")
    time.sleep(60)  # "wait": until a signal


@pytest.fixture
def server():
    s = ForkServer(_target)
    s.start()
    yield s
    s.stop()


def test_exit_codes_and_the_marked_task_come_back(server):
    ok, code3, crash = (server.start_worker((mode,)) for mode in ("ok", "exit3", "crash"))
    for w in (ok, code3, crash):
        w.join(10)
    assert (ok.exitcode, code3.exitcode, crash.exitcode) == (0, 3, 1)
    assert ok.task == code3.task == crash.task == 41  # read from the shared cell after death


def test_a_killed_worker_reads_as_multiprocessing_says(server):
    w = server.start_worker(("wait",))
    assert w.is_alive() and w.pid in host_worker_pids(os.getpid())
    w.kill()
    w.join(10)
    assert w.exitcode == -signal.SIGKILL and not w.is_alive()


def test_stopping_the_server_stops_its_workers():
    s = ForkServer(_target)
    s.start()
    workers = [s.start_worker(("wait",)) for _ in range(2)]
    s.stop()  # the agent closes its pipe: the server terminates its workers, then exits
    assert s.gone
    assert not any(running(w.pid) for w in workers)


def test_a_dead_server_is_noticed_and_starts_nothing():
    s = ForkServer(_target)
    s.start()
    w = s.start_worker(("wait",))
    os.kill(s.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not s.gone and time.monotonic() < deadline:
        s.poll(0.1)
    assert s.gone and not w.is_alive()  # its worker was told to stop, and counts as exited
    with pytest.raises(RuntimeError, match="fork server is gone"):
        s.start_worker(("ok",))
    deadline = time.monotonic() + 10
    while running(w.pid):
        assert time.monotonic() < deadline, "the orphaned worker kept running"
        time.sleep(0.05)
