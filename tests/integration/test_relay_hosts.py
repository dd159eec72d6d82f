"""Several hosts for real, with relays: 4 trainer hosts of 4 ranks each behind their `msd relay`,
and 2 worker hosts, each host a network namespace on one bridge (as test_two_hosts.py makes one).
Workers reach a trainer host only at its relay's address; its ranks speak ipc to their relay. The
ranks get the stream of the direct path, a relay killed and started again loses nothing, and each
worker process holds one data connection per relay (not one per rank).

Needs root and `ip netns` (this project's CI and dev machines have both); where they are missing
the test says so and is skipped: the namespaces are the external boundary here.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from msd.testing.local import LocalJob
from msd.testing.processes import stop
from tests.conftest import job_dict, write_job

from .harness import check_content, run_job, run_ranks, signature
from .test_two_hosts import _ip

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 12
COMPUTE_S = 0.25  # per step: the relay is killed while its ranks still need steps beyond the look-ahead
TRAINER_HOSTS, RANKS_PER_HOST, WORKER_HOSTS = 4, 4, 2
# dp=8 x tp=2, every rank receiving: a host's 4 ranks are 2 DP ranks of 2 TP ranks each, so a relay
# takes each DP rank's pieces once and passes them to 2 ranks
TOPOLOGY = {"dp": 8, "tp": 2, "delivery": "all"}


@pytest.fixture
def hosts():
    """{name: (namespace, address)} of hosts on one bridge, and this side's address on it."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make network namespaces")
    tag = f"{os.getpid() % 10000}"
    octet = os.getpid() % 200 + 20
    bridge, near = f"msdbr{tag}", f"10.{octet}.88.1"
    names = [f"trainer{i}" for i in range(TRAINER_HOSTS)] + [f"worker{i}" for i in range(WORKER_HOSTS)]
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{near}/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        out = {}
        for i, name in enumerate(names):
            ns, here, there = f"msd-{name}-{tag}", f"msd{tag}h{i}", f"msd{tag}n{i}"
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", here, "type", "veth", "peer", "name", there)
            _ip("link", "set", there, "netns", ns)
            _ip("link", "set", here, "master", bridge)
            _ip("link", "set", here, "up")
            address = f"10.{octet}.88.{10 + i}"
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", there)
            _ip("-n", ns, "link", "set", there, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            out[name] = (ns, address)
    except subprocess.CalledProcessError as e:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e.stderr.strip()}")
    try:
        yield out, near
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def _in(ns: str, *command: str, log: str) -> subprocess.Popen:
    return subprocess.Popen(["ip", "netns", "exec", ns, *command], stderr=open(log, "ab"), stdout=subprocess.DEVNULL)


def _data_connections(ns: str, relay_addresses: set[str]) -> dict[str, dict[str, int]]:
    """Per worker process in the namespace (by pid): established TCP connections per peer that is a relay."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-Htnp", "state", "established"], capture_output=True,
                         text=True, check=True).stdout
    by_pid: dict[str, dict[str, int]] = {}
    for line in out.splitlines():
        fields = line.split()
        peer = fields[3] if len(fields) > 3 else ""
        if peer not in relay_addresses or "pid=" not in line:
            continue
        pid = line.split("pid=", 1)[1].split(",", 1)[0]
        by_pid.setdefault(pid, {}).setdefault(peer, 0)
        by_pid[pid][peer] += 1
    return by_pid


def test_four_trainer_hosts_behind_relays_and_two_worker_hosts(dataset_dir, hosts, tmp_path):
    machines, near = hosts
    path = write_job(dataset_dir, job_dict(topology=TOPOLOGY, batch={"seq_len": 512, "micro_batch_size": 2,
                                                                     "global_batch_size": 16}), "relay-hosts.yaml")
    ranks = TRAINER_HOSTS * RANKS_PER_HOST
    direct = run_job(path, workers=1, ranks=ranks, steps=STEPS, timeout_s=240)
    local = {i: f"ipc://{tmp_path}/relay-{i}.sock" for i in range(TRAINER_HOSTS)}
    ports = {i: 41000 + os.getpid() % 1000 * 4 + i for i in range(TRAINER_HOSTS)}  # fixed: a restart keeps it
    logs = {i: str(tmp_path / f"relay-{i}.log") for i in range(TRAINER_HOSTS)}
    with LocalJob(path, workers=0, bind=f"tcp://{near}:0", log_level="INFO") as cluster:
        msd = os.path.join(os.path.dirname(sys.executable), "msd")
        workers = [_in(machines[f"worker{w}"][0], msd, "worker", "--coordinator", cluster.address, "--procs", "1",
                       log=str(tmp_path / f"worker-{w}.log")) for w in range(WORKER_HOSTS)]

        def relay(i: int) -> subprocess.Popen:
            ns, address = machines[f"trainer{i}"]
            return _in(ns, sys.executable, "-m", "msd.cli", "relay", "--coordinator", cluster.address, "--host",
                       address, "--port", str(ports[i]), "--local", local[i], log=logs[i])

        relays = {i: relay(i) for i in range(TRAINER_HOSTS)}
        relay_addresses = {f"{machines[f'trainer{i}'][1]}:{ports[i]}" for i in range(TRAINER_HOSTS)}
        seen: dict = {}

        def during(c, n):  # n: micro-batches received, one a step per rank
            if "before" not in seen and n >= ranks * 2:  # a few steps in
                seen["before"] = {w: _data_connections(machines[f"worker{w}"][0], relay_addresses)
                                  for w in range(WORKER_HOSTS)}
            if "killed" not in seen and n >= ranks * 3:  # SIGKILL one relay; its supervisor starts it again
                relays[0].send_signal(signal.SIGKILL)
                relays[0].wait()
                seen["killed"] = time.monotonic()
                relays[0] = relay(0)

        try:
            received, _ = run_ranks(cluster, ranks=ranks, steps=STEPS, timeout_s=300, during=during,
                                    compute_s=COMPUTE_S, relays={r: local[r // RANKS_PER_HOST] for r in range(ranks)})
            seen["after"] = {w: _data_connections(machines[f"worker{w}"][0], relay_addresses)  # the kill, served
                             for w in range(WORKER_HOSTS)}
        finally:
            stop([*relays.values(), *workers])
    assert "killed" in seen
    assert signature(received) == signature(direct)  # nothing lost or twice, through the kill too
    assert check_content(path, received) > 50
    # at most one data connection per relay in each worker process, whatever the number of ranks behind
    # it (16 ranks: a direct worker would hold 16); between them the workers reach every relay
    for when in ("before", "after"):
        processes = [peers for by_pid in seen[when].values() for peers in by_pid.values()]
        assert processes, f"{when}: no worker holds a connection to a relay"
        assert all(set(peers.values()) == {1} for peers in processes), (when, seen[when])
        assert set().union(*processes) == relay_addresses, (when, seen[when])
