"""Issue 48: every failure reaches the person who can act, within seconds.

Tried as a new user would: a job that the coordinator stops (a transform failing on every record)
left its ranks waiting out timeout_s (300 s) for `PeerLostError: no micro-batch for 300s`, without
the reason; a rank or a worker started with no coordinator at its address said nothing at all."""

from __future__ import annotations

import logging
import sys
import threading
import time

import pytest

from msd.testing.local import LocalJob
from msd.testing.ports import free_address
from tests.conftest import job_dict, write_job
from trainer_client import DataClient, MsdError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def _failing_job(dataset_dir: str, tmp_path) -> str:
    # each record takes a moment before it fails, so that the ranks are in before the job stops
    (tmp_path / "failing_slowly.py").write_text(
        "import time\ndef f(record, ctx):\n    time.sleep(0.3)\n    return record['no_such_field']\n")
    job = job_dict()
    job["sources"]["web"].update(transform="failing_slowly:f", max_transform_errors=5)
    job["runtime"]["failed_linger_s"] = 5  # long enough to tell every rank why; then the coordinator exits
    job["sources"] = {k: {**v, "paths": [f"{dataset_dir}/{v['paths'][0]}"]} for k, v in job["sources"].items()}
    return write_job(str(tmp_path), job)


@pytest.mark.parametrize("through_relay", [False, True], ids=["direct", "relay"])
def test_a_job_the_coordinator_stops_raises_its_reason_in_every_rank_within_seconds(dataset_dir, tmp_path,
                                                                                   through_relay):
    import subprocess

    from msd.testing.processes import stop

    path = _failing_job(dataset_dir, tmp_path)
    sys.path.insert(0, str(tmp_path))
    outcome: dict[int, tuple[float, BaseException | None]] = {}
    endpoint = f"ipc://{tmp_path}/relay.sock" if through_relay else None

    def rank(r: int, address: str, started: float) -> None:
        client = DataClient(address, rank=r, timeout_s=300, relay=endpoint)
        try:
            for _ in client:
                pass
            outcome[r] = (time.monotonic() - started, None)
        except BaseException as e:  # noqa: BLE001 - what the trainer would see
            outcome[r] = (time.monotonic() - started, e)
        finally:
            client.close()

    try:
        with LocalJob(path, workers=1, state_dir=str(tmp_path / "state")) as cluster:
            relay = subprocess.Popen([sys.executable, "-m", "msd.cli", "relay", "--coordinator", cluster.address,
                                      "--local", endpoint]) if endpoint else None
            started = time.monotonic()
            threads = [threading.Thread(target=rank, args=(r, cluster.address, started)) for r in (0, 1)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            stopped = time.monotonic()
            while cluster.coordinator.is_alive() and time.monotonic() - stopped < 30:
                time.sleep(0.1)
            if relay is not None:
                relay.wait(10)  # the relay stops with the job
                stop([relay])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("failing_slowly", None)
    assert sorted(outcome) == [0, 1], "a rank still waits"
    for r, (seconds, error) in outcome.items():
        assert isinstance(error, MsdError), (r, error)
        assert "5 consecutive records failed in transform failing_slowly:f" in str(error), (r, str(error))
        assert "no_such_field" in str(error)
        assert seconds < 30, (r, seconds)

    # msd status, after the job: it says that the job failed, and why
    import orjson
    from click.testing import CliRunner

    from msd.cli import main

    shown = CliRunner().invoke(main, ["status", "--state-dir", str(tmp_path / "state"), "--json", "--timeout-s", "1"])
    assert shown.exit_code == 1
    status = orjson.loads(shown.stdout)
    assert "5 consecutive records failed in transform failing_slowly:f" in status["failed"]
    shown = CliRunner().invoke(main, ["status", "--state-dir", str(tmp_path / "state"), "--timeout-s", "1"])
    assert "JOB FAILED: source 'web': 5 consecutive records failed" in shown.stdout


def test_a_rank_with_no_coordinator_says_what_it_waits_for_and_names_the_address(caplog):
    address = free_address()
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="msd"):
        client = DataClient(address, rank=0, timeout_s=4)
        with pytest.raises(MsdError) as raised:
            next(iter(client))
        client.close()
    assert time.monotonic() - started < 15
    assert address in str(raised.value)
    waiting = [r.getMessage() for r in caplog.records if "waiting for the coordinator" in r.getMessage()]
    assert waiting and address in waiting[0]


def test_a_worker_host_with_no_coordinator_says_what_it_waits_for(tmp_path):
    import subprocess

    from msd.testing.processes import msd_command

    address = free_address()
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([msd_command(), "worker", "--coordinator", address, "--procs", "1"], stdout=out,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and "worker host: waiting for the coordinator" not in log.read_text():
                time.sleep(0.2)
        finally:
            proc.terminate()
            proc.wait(10)
    text = log.read_text()
    line = next(l for l in text.splitlines() if "worker host: waiting for the coordinator" in l)
    assert address in line and "no welcome after" in line
