"""The host's fork server (worker/forks.py): real forks, real pipes, real signals, a real fresh
interpreter. The test process plays the host agent, so it becomes a child subreaper as the agent
does (orphans of other tests' processes come to it as zombies: running() does not count them)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from msd.testing.processes import running
from worker import forks
from worker.forks import ForkServer, fork_server_pids, host_worker_pids

TARGET = "tests.unit.test_forks:_target"


def _target(mode: str, cell) -> None:
    """A stand-in worker: marks a task and a sample, then ends as `mode` says."""
    cell.task, cell.source, cell.record = 41, 2, 7
    if mode == "slow":  # a sample allowed 0.1 s that takes a minute
        cell.limit_ns = 100_000_000
        cell.started_ns = time.monotonic_ns()
        time.sleep(60)
    if mode == "ok":
        return
    if mode == "exit3":
        raise SystemExit(3)
    if mode == "crash":
        raise RuntimeError("a bug")
    time.sleep(60)  # "wait": until a signal


@pytest.fixture
def server():
    s = ForkServer(_target, TARGET)
    s.start()
    yield s
    s.stop()


def _lingered_out(s: ForkServer, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while s.running:
        assert time.monotonic() < deadline, "the server did not exit"
        s.poll(0.1)


def test_exit_codes_and_the_marked_task_come_back(server):
    ok, code3, crash = (server.start_worker((mode,)) for mode in ("ok", "exit3", "crash"))
    for w in (ok, code3, crash):
        w.join(10)
    assert (ok.exitcode, code3.exitcode, crash.exitcode) == (0, 3, 1)
    assert ok.task == code3.task == crash.task == 41  # read from the shared cell after death
    assert (crash.source, crash.record) == (2, 7)


def test_a_sample_past_its_limit_is_seen_by_the_agent_and_its_worker_stopped(server):
    """The agent's clock of a worker's sample: no overrun while it is within its limit (a worker
    merely waiting has none at all), one once it is past, and the stopped worker's exit says which
    sample it was and by how much it ran over."""
    waiting, slow = server.start_worker(("wait",)), server.start_worker(("slow",))
    deadline = time.monotonic() + 10
    while slow.overrun_s() == 0:
        assert time.monotonic() < deadline, "the slow sample was never past its limit"
        time.sleep(0.02)
    assert waiting.overrun_s() == 0 and waiting.is_alive()
    slow.stop_overrun(slow.overrun_s())
    slow.join(10)
    waiting.kill()
    waiting.join(10)
    assert slow.exitcode == -9 and slow.overran_s > 0
    assert (slow.task, slow.source, slow.record) == (41, 2, 7)


def test_workers_are_the_agents_children_and_a_killed_one_reads_as_multiprocessing_says(server):
    w = server.start_worker(("wait",))
    assert w.is_alive() and w.pid in host_worker_pids(os.getpid())  # adopted: not the server's child
    assert w.task == -1
    deadline = time.monotonic() + 10
    while server.cells.cell(w._cell).task != 41:  # it marked its task
        assert time.monotonic() < deadline
        time.sleep(0.01)
    w.kill()
    w.join(10)
    assert w.exitcode == -signal.SIGKILL and not w.is_alive() and w.task == 41


def test_the_server_exits_when_idle_and_a_later_start_gets_a_fresh_one(monkeypatch):
    monkeypatch.setattr(forks, "LINGER_S", 0.5)  # read by the forked server
    s = ForkServer(_target, TARGET)
    s.start()
    try:
        first_server = s.pid
        early = s.start_worker(("wait",))
        _lingered_out(s)
        assert not running(first_server) and first_server not in fork_server_pids(os.getpid())
        assert early.is_alive()  # the worker outlives its server
        late = s.start_worker(("exit3",))  # a fresh interpreter imports the worker's modules, then forks
        assert s.servers_started == 2 and s.pid != first_server
        late.join(30)
        assert late.exitcode == 3 and late.task == 41  # the cells are shared with the fresh server too
        early.terminate()
        early.join(10)
        assert early.exitcode == -signal.SIGTERM
    finally:
        s.stop()


def test_a_dead_server_is_replaced_at_the_next_start(server):
    w = server.start_worker(("wait",))
    os.kill(server.pid, signal.SIGKILL)
    _lingered_out(server)
    assert w.is_alive()  # the agent's child, not the server's
    again = server.start_worker(("ok",))
    again.join(30)
    assert again.exitcode == 0 and server.servers_started == 2
    w.kill()
    w.join(10)
    assert not running(w.pid)


def test_stopping_the_server_leaves_the_workers_to_the_agent(server):
    w = server.start_worker(("wait",))
    server.stop()
    assert not server.running and w.is_alive()
    w.terminate()
    w.join(10)
    assert w.exitcode == -signal.SIGTERM
