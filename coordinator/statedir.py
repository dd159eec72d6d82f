"""The records of a state dir besides the journals: the job a state was written for (`job.json`),
where the coordinator listens (`coordinator.json`) and its last status (`status.json`). Written
by the shell at start-up and from file instructions; every write is atomic (temp, fsync, rename).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import orjson

from msd_common import protocol as P
from msd_common.errors import MsdError
from msd_common.files import atomic_write

from msd_common.spec import JobConfig, config_diff

log = logging.getLogger("msd.coordinator")
JOB_RECORD = "job.json"
STATE_FILE = "coordinator.json"
STATUS_FILE = "status.json"


def write_json_atomically(path: str, value: Any) -> None:
    atomic_write(path, orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS))


class JobChanged(MsdError):
    def __init__(self, state_dir: str, diff: list[str]) -> None:
        self.diff = diff
        super().__init__(f"{state_dir}: the job file changed since this state was written; refusing to continue "
                         "(--allow-config-change to continue anyway):\n" + "\n".join(f"  {d}" for d in diff))


def check_job_change(state_dir: str | None, job: JobConfig, allow: bool) -> bool:
    """Compare the job with the one the state dir was written for, and record the job there.
    A changed topology is an elastic resume (the global stream does not depend on it). Any other
    change raises JobChanged with the differences, unless allowed. Returns whether the stream
    definition changed (and was allowed)."""
    if not state_dir:
        return False
    os.makedirs(state_dir, exist_ok=True)
    path = os.path.join(state_dir, JOB_RECORD)
    current = {"stream": job.stream_definition(), "topology": job.topology._asdict()}
    changed = False
    try:
        with open(path, "rb") as f:
            previous = orjson.loads(f.read())
    except FileNotFoundError:
        previous = None
    if previous is not None:
        diff = config_diff(previous.get("stream"), current["stream"])
        if diff and previous.get("stream") == job.stream_definition(where=True):
            diff = []  # recorded by 0.3.0, whose definition held the data's absolute paths: the same job
        if diff and not allow:
            raise JobChanged(state_dir, diff)
        if diff:
            log.warning("the job changed (allowed by --allow-config-change): %s", "; ".join(diff))
            changed = True
        topo = config_diff(previous.get("topology"), current["topology"], "topology")
        if topo:
            log.warning("elastic resume: %s; the same global stream continues over the new ranks", "; ".join(topo))
    write_json_atomically(path, current)
    return changed


def read_state_file(state_dir: str) -> dict[str, Any]:
    """The record the state dir's coordinator left (address, digest, job file, pid, protocol);
    OSError or ValueError (orjson's) if there is none or it is not JSON."""
    with open(os.path.join(state_dir, STATE_FILE), "rb") as f:
        return orjson.loads(f.read())


def write_state_file(state_dir: str, job: JobConfig, address: str) -> None:
    """Record where this coordinator listens and which job it runs. Tools find the coordinator
    from here; a restart whose job digest differs is reported."""
    os.makedirs(state_dir, exist_ok=True)
    path = os.path.join(state_dir, STATE_FILE)
    try:
        previous = read_state_file(state_dir)
        if previous.get("digest") not in (job.digest(), *job.earlier_digests()):
            log.warning("%s: the job file changed since the last run (digest %s, now %s)", path,
                        previous.get("digest"), job.digest())
    except (OSError, orjson.JSONDecodeError):
        pass
    record = {"address": address, "digest": job.digest(), "job": os.path.abspath(job.path), "pid": os.getpid(),
              "protocol": P.PROTOCOL_VERSION}
    write_json_atomically(path, record)


def write_status(state_dir: str, status: dict[str, Any]) -> None:
    write_json_atomically(os.path.join(state_dir, STATUS_FILE), status)
