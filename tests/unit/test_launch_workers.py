"""The SSH launcher's host list and the commands it runs (it runs them for real in
tests/integration/test_two_hosts.py, with `ip netns exec` standing in for ssh)."""

import subprocess
import sys

import pytest

sys.path.insert(0, "tools")
from launch_workers import parse_hosts, remote_command  # noqa: E402


def test_host_list_options_and_commands():
    hosts = parse_hosts("# cluster\nnode1\nops@node2 procs=8\nnode3 max_procs=4  # big\n\n", "auto", 16)
    assert [(h.name, h.procs, h.max_procs) for h in hosts] == [
        ("node1", "auto", 16), ("ops@node2", "8", 16), ("node3", "auto", 4)]
    assert remote_command(hosts[0], "tcp://head:5555", "msd", "/etc/msd keys", "INFO") == (
        "exec msd worker --coordinator tcp://head:5555 --procs auto --log-level INFO --max-procs 16 "
        "--keys '/etc/msd keys'")
    assert "--max-procs" not in remote_command(hosts[1], "tcp://head:5555", "msd", None, "INFO")


def test_bad_host_line_names_the_line():
    with pytest.raises(SystemExit, match="hosts:2: unknown option 'cpus=3'"):
        parse_hosts("a\nb cpus=3\n", "auto", None, "hosts")


def test_dry_run_prints_one_ssh_command_per_host(tmp_path):
    (tmp_path / "hosts").write_text("n1\nn2 procs=2\n")
    out = subprocess.run([sys.executable, "tools/launch_workers.py", "--hosts", str(tmp_path / "hosts"),
                          "--coordinator", "tcp://h:1", "--dry-run"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[1].startswith("ssh -tt -o BatchMode=yes")
    assert lines[1].endswith("n2 'exec msd worker --coordinator tcp://h:1 --procs 2 --log-level INFO'")
