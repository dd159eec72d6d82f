"""CURVE: with security.curve every connection is encrypted, and a worker or a trainer client
without an authorised key gets nothing."""

import time

import pytest
from click.testing import CliRunner

from msd.cli import main
from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from trainer_client import DataClient, RejectedError

from .harness import check_content

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    good, other = tmp_path_factory.mktemp("keys"), tmp_path_factory.mktemp("other-keys")
    for d in (good, other):
        r = CliRunner().invoke(main, ["keys", "generate", str(d)])
        assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["keys", "generate", str(good)])
    assert r.exit_code == 1 and "exist already" in r.output
    return str(good), str(other)


def _job(dataset_dir, keys_dir):
    return write_job(dataset_dir, job_dict(topology={"dp": 1}, security={"curve": keys_dir}), "curve.yaml")


def test_authorised_workers_and_clients_are_served(dataset_dir, keys):
    good, _ = keys
    path = _job(dataset_dir, good)
    with LocalJob(path, workers=1, worker_keys=good) as job:
        with DataClient(job.address, rank=0, as_torch=False, timeout_s=30, keys_dir=good) as client:
            received = {0: [next(client) for _ in range(6)]}
    assert check_content(path, received) > 5


def test_with_index_on_workers_the_counting_workers_need_the_key_too(tmp_path, keys):
    """The sources are counted by the workers (runtime.index_on: workers) over the same encrypted
    socket that then serves the job: an authorised host counts, and the job is served."""
    from tests.conftest import build_dataset

    good, other = keys
    root = str(tmp_path / "data")
    build_dataset(root)  # fresh shards: nothing indexed yet
    runtime = {**job_dict()["runtime"], "index_on": "workers"}
    path = write_job(root, job_dict(topology={"dp": 1}, security={"curve": good}, runtime=runtime), "curve.yaml")
    log = str(tmp_path / "job.log")
    with LocalJob(path, workers=1, worker_keys=good, log_path=log, log_level="INFO") as job:
        with DataClient(job.address, rank=0, as_torch=False, timeout_s=60, keys_dir=good) as client:
            received = {0: [next(client) for _ in range(6)]}
    assert check_content(path, received) > 5
    assert "workers counted 2 source(s)" in open(log).read()


def test_a_client_without_an_authorised_key_is_refused_and_told_why(dataset_dir, keys):
    good, other = keys
    with LocalJob(_job(dataset_dir, good), workers=1, worker_keys=good) as job:
        # plain, or a key the coordinator does not know; several times: which side sees a plain
        # peer's mismatch first is a race, and a client that saw it itself once waited forever
        for keys_dir in (None, other) * 4:
            started = time.monotonic()
            with DataClient(job.address, rank=0, as_torch=False, timeout_s=60, keys_dir=keys_dir) as intruder:
                with pytest.raises(RejectedError, match="security.curve") as refused:
                    next(intruder)
            assert time.monotonic() - started < 20  # the refusal is seen, not waited out
            assert "handshake" in str(refused.value) or "key" in str(refused.value)
        # the job itself is untouched: an authorised client is served
        with DataClient(job.address, rank=0, as_torch=False, timeout_s=30, keys_dir=good) as client:
            assert next(client)["step"] == 0


def test_a_worker_host_without_an_authorised_key_stops_and_says_why(dataset_dir, keys, tmp_path):
    good, other = keys
    log = str(tmp_path / "job.log")
    with LocalJob(_job(dataset_dir, good), workers=1, worker_keys=other, log_path=log, log_level="INFO") as job:
        job.host.join(30)  # it stops by itself
        assert job.host.exitcode == 1
    with open(log) as f:
        text = f.read()
    assert "refuses this host" in text and "check --keys" in text


def _trainer_only(keys_dir, tmp_path):
    """What a trainer host holds: its own pair and the coordinator's public key, no operator key."""
    import shutil

    d = tmp_path / "trainer-host"
    d.mkdir()
    for name in ("trainer.key", "trainer.key_secret", "coordinator.key"):
        shutil.copy(f"{keys_dir}/{name}", d / name)
    return str(d)


def test_operator_commands_on_a_secured_job_need_the_operator_key(dataset_dir, keys, tmp_path):
    import orjson

    good, _ = keys
    trainer_host = _trainer_only(good, tmp_path)
    with LocalJob(_job(dataset_dir, good), workers=1, worker_keys=good) as job:
        with DataClient(job.address, rank=0, as_torch=False, timeout_s=30, keys_dir=good) as client:
            next(client)
            # without keys, a tool completes no handshake and says what is missing
            r = CliRunner().invoke(main, ["mix", "--coordinator", job.address, "--at-step", "50", "web=1",
                                          "--timeout-s", "2"])
            assert r.exit_code == 1 and "--keys" in r.output, r.output
            # a trainer's key is authorised, but not to change the plan
            r = CliRunner().invoke(main, ["mix", "--coordinator", job.address, "--at-step", "50", "web=1",
                                          "--keys", trainer_host])
            assert r.exit_code == 1 and "only from an operator key" in r.output, r.output
            # the operator's key is
            r = CliRunner().invoke(main, ["mix", "--coordinator", job.address, "--at-step", "50", "web=1",
                                          "--keys", good])
            assert r.exit_code == 0, r.output
            # any authorised key may read status
            r = CliRunner().invoke(main, ["status", "--coordinator", job.address, "--keys", trainer_host, "--json"])
            assert r.exit_code == 0, r.output
            status = orjson.loads(r.output)
            assert status["target_share"] and status["dp"] == 1
            assert any("mixture changed from step 50" in w for w in status["warnings"])


def test_keys_generate_adds_an_operator_pair_to_an_older_key_set(tmp_path):
    import os

    d = tmp_path / "old"
    assert CliRunner().invoke(main, ["keys", "generate", str(d)]).exit_code == 0
    for name in ("operator.key", "operator.key_secret", "authorized/operator.key"):
        os.remove(d / name)  # a key set made before operator keys existed
    r = CliRunner().invoke(main, ["keys", "generate", str(d)])
    assert r.exit_code == 0, r.output
    assert sorted(line for line in r.output.splitlines() if line.startswith("/")) == sorted(
        str(d / n) for n in ("operator.key", "operator.key_secret", "authorized/operator.key"))


def test_workers_in_the_coordinators_process_use_the_jobs_keys(dataset_dir, keys, tmp_path):
    """msd coordinator --worker-procs: its host's agent and workers take the worker key from the
    job's key directory (security.curve), and an authorised client is served by them."""
    import signal
    import subprocess

    from msd.testing.ports import free_address
    from msd.testing.processes import msd_command

    good, _ = keys
    path, address = _job(dataset_dir, good), free_address()
    msd = msd_command()
    with open(tmp_path / "coordinator.log", "wb") as log:
        coordinator = subprocess.Popen([msd, "coordinator", "--config", path, "--bind", address, "--worker-procs", "1"],
                                       stderr=log)
    try:
        with DataClient(address, rank=0, as_torch=False, timeout_s=60, keys_dir=good) as client:
            received = {0: [next(client) for _ in range(6)]}
        assert check_content(path, received) > 5
    finally:
        coordinator.send_signal(signal.SIGTERM)
        coordinator.wait(60)
    assert "refuses this host" not in (tmp_path / "coordinator.log").read_text()


def test_a_relay_speaks_for_its_ranks_with_the_trainer_key(dataset_dir, keys, tmp_path):
    """On a CURVE job the relay authenticates with the trainer key and accepts data only from
    authorised workers; its ranks speak ipc to it, on their own host. A relay with another key
    gets nothing, and its ranks are told why."""
    import subprocess
    import sys

    from msd.testing.processes import stop

    good, other = keys
    path = _job(dataset_dir, good)
    with LocalJob(path, workers=1, worker_keys=good) as job:
        endpoint = f"ipc://{tmp_path}/relay.sock"
        relay = subprocess.Popen([sys.executable, "-m", "msd.cli", "relay", "--coordinator", job.address, "--local",
                                  endpoint, "--keys", good])
        try:
            with DataClient(job.address, rank=0, as_torch=False, timeout_s=30, relay=endpoint) as client:
                received = {0: [next(client) for _ in range(6)]}
        finally:
            stop([relay])
        assert check_content(path, received) > 5
        wrong = f"ipc://{tmp_path}/wrong.sock"
        relay = subprocess.Popen([sys.executable, "-m", "msd.cli", "relay", "--coordinator", job.address, "--local",
                                  wrong, "--keys", other])
        try:
            with DataClient(job.address, rank=0, as_torch=False, timeout_s=6, relay=wrong) as client:
                with pytest.raises(Exception) as refused:
                    next(client)
        finally:
            stop([relay])
    assert refused.type is RejectedError and "refused the relay's connection" in str(refused.value)
