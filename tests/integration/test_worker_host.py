"""The `msd worker` host's processes as an operator sees them: the agent, its fork server
(`msd-forks`) and the workers it forks (`msd-worker`), and how they end with the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from coordinator.testing.ports import free_address
from coordinator.testing.processes import msd_command, wait_gone
from worker.forks import SERVER_NAME, WORKER_NAME, host_worker_pids, process_comm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]



def _start_host(procs: int) -> tuple[subprocess.Popen, int, list[int]]:
    """An agent (no coordinator answers: its workers keep saying hello), its server and workers."""
    agent = subprocess.Popen([msd_command(), "worker", "--coordinator", free_address(), "--procs", str(procs),
                              "--log-level", "WARNING"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(host_worker_pids(agent.pid)) < procs:
        assert agent.poll() is None and time.monotonic() < deadline, "the host did not start its workers"
        time.sleep(0.1)
    with open(f"/proc/{agent.pid}/task/{agent.pid}/children") as f:
        server = next(int(p) for p in f.read().split() if process_comm(int(p)) == SERVER_NAME)
    return agent, server, host_worker_pids(agent.pid)



def test_the_host_names_its_processes_and_a_stopped_agent_stops_them_all():
    agent, server, workers = _start_host(2)
    assert [process_comm(p) for p in workers] == [WORKER_NAME, WORKER_NAME]
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(30) == 0
    wait_gone([server, *workers], timeout_s=15)


def test_a_killed_agent_leaves_no_process_behind():
    agent, server, workers = _start_host(2)
    agent.kill()
    agent.wait(10)
    wait_gone([server, *workers], timeout_s=15)  # the server sees the agent's pipe close and stops its workers


def test_a_killed_worker_is_forked_again():
    agent, server, workers = _start_host(1)
    try:
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (host_worker_pids(agent.pid) and host_worker_pids(agent.pid) != workers):
            assert time.monotonic() < deadline, "no new worker process"
            time.sleep(0.1)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    wait_gone([server, *host_worker_pids(agent.pid)], timeout_s=15)
