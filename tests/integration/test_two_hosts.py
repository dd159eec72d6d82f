"""The multi-host path for real: a worker host in its own network namespace (a second "host",
reached over a veth pair, with its own loopback and addresses) serves trainer ranks and a
coordinator in the first namespace. Nothing crosses on 127.0.0.1: every connection uses the
veth addresses, as it would between machines.

Needs root and `ip netns` (this project's CI and dev machines have both). Where they are
missing the test says so and is skipped: the namespaces are the external boundary here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job

from .harness import check_content, run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 15


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture
def second_host():
    """(namespace, address of this side, address of the other side) of a veth pair."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace")
    tag = f"{os.getpid() % 100000}"
    ns, here, there = f"msd-host2-{tag}", f"msdv{tag}a", f"msdv{tag}b"
    octet = os.getpid() % 200 + 20
    near, far = f"10.{octet}.77.1", f"10.{octet}.77.2"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", ns)
        _ip("addr", "add", f"{near}/30", "dev", here)
        _ip("link", "set", here, "up")
        _ip("-n", ns, "addr", "add", f"{far}/30", "dev", there)
        _ip("-n", ns, "link", "set", there, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as e:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        pytest.skip(f"cannot make a network namespace here: {e.stderr.strip()}")
    try:
        yield ns, near, far
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_worker_host_in_another_namespace_serves_the_ranks(dataset_dir, second_host, tmp_path):
    ns, near, far = second_host
    path = write_job(dataset_dir, job_dict(), "two-hosts.yaml")
    log = tmp_path / "host2.log"
    with LocalJob(path, workers=0, bind=f"tcp://{near}:0", log_level="INFO") as cluster:
        assert cluster.address.startswith(f"tcp://{near}:")
        # the second host cannot even see this side's loopback: only the veth address works
        probe = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c",
                                "import socket; socket.create_connection(('%s', %s), timeout=2)"
                                % (near, cluster.address.rsplit(":", 1)[1])], capture_output=True)
        assert probe.returncode == 0, probe.stderr.decode()
        # Started by the SSH launcher; "ssh" into the second host is `ip netns exec` (no sshd here).
        fake_ssh = tmp_path / "ssh-into-namespace"
        fake_ssh.write_text(f'#!/bin/sh\nshift  # the host name\nexec ip netns exec {ns} sh -c "$*"\n')
        fake_ssh.chmod(0o755)
        (tmp_path / "hosts.txt").write_text("second-host procs=2  # the namespace\n")
        msd = os.path.join(os.path.dirname(sys.executable), "msd")
        with open(log, "w") as out:
            agent = subprocess.Popen([sys.executable, "tools/launch_workers.py", "--hosts", str(tmp_path / "hosts.txt"),
                                      "--coordinator", cluster.address, "--msd", msd, "--ssh", str(fake_ssh)],
                                     stdout=out, stderr=subprocess.STDOUT, cwd=os.getcwd())
        try:
            received, _ = run_ranks(cluster, ranks=2, steps=STEPS, client_host=near, timeout_s=150)
        finally:
            agent.terminate()
            agent.wait(timeout=20)
    text = log.read_text()
    assert "registered as worker" in text  # the workers in the other namespace did the work
    assert f"[launch] second-host: {fake_ssh} second-host 'exec {msd} worker --coordinator" in text
    assert check_content(path, received) > 50
    assert signature(received) == signature(run_job(path, workers=1, ranks=2, steps=STEPS))
