"""The `msd worker` host's processes as an operator sees them: the agent, its fork server
(`msd-forks`, while it starts workers) and the workers it forks (`msd-worker`, the agent's
children), and how they end with the agent."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from msd.testing.ports import free_address
from msd.testing.processes import msd_command, wait_gone
from worker.forks import LINGER_S, WORKER_NAME, fork_server_pids, host_worker_pids, process_comm

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]



def _start_host(procs: int) -> tuple[subprocess.Popen, int, list[int]]:
    """An agent (no coordinator answers: its workers keep saying hello), its server and workers."""
    agent = subprocess.Popen([msd_command(), "worker", "--coordinator", free_address(), "--procs", str(procs),
                              "--log-level", "WARNING"], stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(host_worker_pids(agent.pid)) < procs:
        assert agent.poll() is None and time.monotonic() < deadline, "the host did not start its workers"
        time.sleep(0.1)
    server = fork_server_pids(agent.pid)[0]  # it lingers LINGER_S after its last start
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
    wait_gone([server, *workers], timeout_s=15)  # the server sees the agent's pipe close; the workers their parent go


def test_a_killed_worker_is_forked_again_by_a_fresh_server_once_the_first_has_gone():
    agent, server, workers = _start_host(1)
    try:
        wait_gone([server], timeout_s=LINGER_S + 10)  # idle: it exits; the worker runs on
        assert host_worker_pids(agent.pid) == workers
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not (host_worker_pids(agent.pid) and host_worker_pids(agent.pid) != workers):
            assert time.monotonic() < deadline, "no new worker process"
            time.sleep(0.1)
        fresh, again = fork_server_pids(agent.pid), host_worker_pids(agent.pid)
        assert len(fresh) == 1 and fresh[0] != server
        with open(f"/proc/{fresh[0]}/cmdline", "rb") as f:
            assert b"worker.forks" in f.read()  # a fresh interpreter: the agent has threads and sockets by now
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(30)
    wait_gone([*fresh, *again], timeout_s=15)
