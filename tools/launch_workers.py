"""Start `msd worker` host agents on many machines over SSH, and keep them running.

    python tools/launch_workers.py --hosts hosts.txt --coordinator tcp://HEAD:5555 \\
        [--procs auto --max-procs 32] [--keys /etc/msd/keys] [--msd /opt/venv/bin/msd] [--dry-run]

hosts.txt: one host per line (`user@host` works), optionally followed by `procs=N` and/or
`max_procs=M` to override the defaults for that host; `#` starts a comment. Each agent runs in
the foreground of its SSH session (`ssh -tt`, so closing the session stops it); the launcher
restarts a session that ends, with back-off, because workers are stateless and the coordinator
re-prepares whatever a lost host held. Ctrl-C or SIGTERM stops every session.
Key-based, non-interactive SSH (BatchMode) is assumed; `--ssh` replaces the ssh command.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

MAX_BACKOFF_S = 60.0


@dataclass
class Host:
    name: str
    procs: str
    max_procs: int | None
    process: subprocess.Popen | None = None
    failures: int = 0
    next_start: float = 0.0
    started_at: float = field(default=0.0)


def parse_hosts(text: str, procs: str, max_procs: int | None, where: str = "hosts file") -> list[Host]:
    hosts = []
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        h = Host(words[0], procs, max_procs)
        for opt in words[1:]:
            key, _, value = opt.partition("=")
            if key == "procs" and (value == "auto" or value.isdigit()):
                h.procs = value
            elif key == "max_procs" and value.isdigit():
                h.max_procs = int(value)
            else:
                raise SystemExit(f"{where}:{n}: unknown option {opt!r} (expected procs=N|auto, max_procs=M)")
        hosts.append(h)
    if not hosts:
        raise SystemExit(f"{where}: no hosts")
    return hosts


def remote_command(h: Host, coordinator: str, msd: str, keys: str | None, log_level: str) -> str:
    cmd = [msd, "worker", "--coordinator", coordinator, "--procs", h.procs, "--log-level", log_level]
    if h.max_procs is not None and h.procs == "auto":
        cmd += ["--max-procs", str(h.max_procs)]
    if keys:
        cmd += ["--keys", keys]
    return "exec " + shlex.join(cmd)


def ssh_argv(ssh: str, host: str, command: str) -> list[str]:
    return [*shlex.split(ssh), host, command]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", required=True, help="host list file")
    ap.add_argument("--coordinator", required=True, help="coordinator address as the hosts reach it")
    ap.add_argument("--procs", default="auto", help="worker processes per host: N or auto (default)")
    ap.add_argument("--max-procs", type=int, default=None, help="with --procs auto: the most per host")
    ap.add_argument("--keys", default=None, help="key directory on the hosts (security.curve jobs)")
    ap.add_argument("--msd", default="msd", help="the msd command on the hosts (e.g. /opt/venv/bin/msd)")
    ap.add_argument("--ssh", default="ssh -tt -o BatchMode=yes -o ServerAliveInterval=15",
                    help="the ssh command (host and remote command are appended)")
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    args = ap.parse_args(argv)
    with open(args.hosts) as f:
        hosts = parse_hosts(f.read(), args.procs, args.max_procs, args.hosts)
    commands = {h.name: ssh_argv(args.ssh, h.name, remote_command(h, args.coordinator, args.msd, args.keys,
                                                                   args.log_level)) for h in hosts}
    if args.dry_run:
        for argv_ in commands.values():
            print(shlex.join(argv_))
        return 0
    stopping = False

    def stop(*_: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        while not stopping:
            now = time.monotonic()
            for h in hosts:
                if h.process is not None and h.process.poll() is not None:
                    code = h.process.returncode
                    h.failures = 0 if now - h.started_at > 60 else h.failures + 1
                    delay = min(MAX_BACKOFF_S, 2.0 ** h.failures)
                    print(f"[launch] {h.name}: session ended ({code}); restarting in {delay:.0f}s", file=sys.stderr)
                    h.process, h.next_start = None, now + delay
                if h.process is None and now >= h.next_start:
                    print(f"[launch] {h.name}: {shlex.join(commands[h.name])}", file=sys.stderr)
                    h.process, h.started_at = subprocess.Popen(commands[h.name], stdin=subprocess.DEVNULL), now
            time.sleep(0.5)
    finally:
        for h in hosts:
            if h.process is not None and h.process.poll() is None:
                h.process.terminate()
        for h in hosts:
            if h.process is not None:
                try:
                    h.process.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    h.process.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
