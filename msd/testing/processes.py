"""Stopping the processes a test or a benchmark started (`msd coordinator`, `msd worker`, servers)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Iterable


def msd_command() -> str:
    """The `msd` of this Python's environment (the tests' and benchmarks' own install)."""
    return shutil.which("msd", path=os.path.dirname(sys.executable)) or "msd"


def stop(procs: Iterable[subprocess.Popen | None], timeout_s: float = 20.0) -> None:
    """SIGTERM every one still running, all at once (each may take seconds to stop, and the
    others' stops go on meanwhile), then wait for each; one that has not stopped by then is
    killed."""
    procs = [p for p in procs if p is not None]
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def running(pid: int) -> bool:
    """Whether a process is there and not a zombie (Linux /proc): a process that is not ours to
    wait for, such as a fork server's worker, stays a zombie until whatever adopts it reaps it."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids: Iterable[int], timeout_s: float) -> None:
    """Wait until none of these processes runs (running()); fail naming those left."""
    pids = list(pids)
    deadline = time.monotonic() + timeout_s
    while any(running(p) for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if running(p)]}"
        time.sleep(0.1)
