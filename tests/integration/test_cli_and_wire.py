"""`msd coordinator` and `msd worker` as real commands, and a coordinator under bad input."""

import os
import queue
import subprocess
import sys
import time

import msgpack
import orjson
import pytest
import zmq

from msd_common import protocol as P

from msd.testing.ports import free_address, free_port
from msd.testing.processes import stop
from tests.conftest import job_dict, write_job

from .harness import SPAWN, check_content, collect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _msd(*args, log):
    return subprocess.Popen([sys.executable, "-m", "msd.cli", *args], stdout=log, stderr=subprocess.STDOUT)


def _receive(address, ranks, steps, timeout_s=60, while_waiting=None):
    out = SPAWN.Queue()
    procs = [SPAWN.Process(target=collect, args=(address, r, steps, out)) for r in range(ranks)]
    for p in procs:
        p.start()
    received, done, deadline = {r: [] for r in range(ranks)}, 0, time.monotonic() + timeout_s
    try:
        while done < ranks and time.monotonic() < deadline:
            if while_waiting:
                while_waiting()
            try:
                kind, rank, payload = out.get(timeout=0.2)
            except queue.Empty:
                continue
            assert kind != "error", payload
            if kind == "done":
                done += 1
            else:
                received[rank].append(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert done == ranks, "trainers did not finish"
    return received


@pytest.fixture
def cli_job(dataset_dir, tmp_path):
    path = write_job(dataset_dir, job_dict(), "cli.yaml")
    address = free_address()
    log = open(tmp_path / "msd.log", "w+")
    coord = _msd("coordinator", "--config", path, "--bind", address, "--state-dir", str(tmp_path / "state"), log=log)
    host = _msd("worker", "--coordinator", address, "--procs", "2", log=log)
    try:
        yield path, address, log, tmp_path / "state"
    finally:
        stop([host, coord])
        log.close()


def test_msd_commands_serve_a_job(cli_job):
    path, address, log, state_dir = cli_job
    received = _receive(address, ranks=2, steps=10)
    assert all(len(b) == 20 for b in received.values())
    assert check_content(path, received) > 20
    state = orjson.loads((state_dir / "coordinator.json").read_bytes())
    assert state["address"] == address and len(state["digest"]) == 16


def test_malformed_messages_are_dropped_and_the_job_goes_on(cli_job):
    path, address, log, _ = cli_job
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(address)
    bad = [
        [b"\x00\x01garbage"],
        [msgpack.packb([1, 2, 3])],
        [msgpack.packb({"type": "prepare", "task_id": 1, "source": 0, "records": [1]})],  # wrong direction
        [msgpack.packb({"type": "consumed", "rank": 0, "step": 5})],  # not registered
        [msgpack.packb({"type": "trainer_hello", "version": P.PROTOCOL_VERSION, "rank": "zero", "data_address": "x",
                        "resume_step": 0, "incarnation": 1, "metadata_only": 0, "carried": None})],
        [msgpack.packb({"type": "worker_hello", "version": 99, "host": "h", "pid": 1, "incarnation": 1, "agent": 1})],
        [msgpack.packb({"type": "trainer_hello", "version": P.PROTOCOL_VERSION, "rank": 7, "data_address": "tcp://127.0.0.1:1",
                        "resume_step": 0, "incarnation": 1, "metadata_only": 0, "carried": None})],  # rank beyond dp
        [b"\x00" * (9 << 20)],  # oversized header
        [msgpack.packb({"type": "consumed", "rank": 0, "step": 1}), b"extra", b"frames"],
    ]
    sent = []

    def inject():
        if len(sent) < 30:
            for frames in bad:
                rogue.send_multipart(frames)
            sent.append(1)

    inject()  # before the trainers: the rogue is queued even if the job finishes at once
    received = _receive(address, ranks=2, steps=8, while_waiting=inject)
    assert sent
    assert check_content(path, received) > 10
    # The socket stays open until the coordinator has logged what it dropped: closed at once
    # (LINGER 0), the last sends could be discarded before they left, and the coordinator
    # may still be reading them when the trainers finish.
    expected = ("dropped message from peer", "undecodable header", "rank 7 out of range", "speaks protocol 99")
    deadline, text = time.monotonic() + 30, ""
    while time.monotonic() < deadline:
        log.flush()
        log.seek(0)
        text = log.read()
        if all(e in text for e in expected):
            break
        time.sleep(0.2)
    rogue.close()
    ctx.term()
    missing = [e for e in expected if e not in text]
    assert not missing, f"not logged: {missing}"


def test_msd_demo_writes_its_summary(tmp_path):
    out = tmp_path / "demo.json"
    env = {**os.environ, "MSD_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "msd.cli", "demo", "--steps", "6", "--ranks", "2", "--workers",
                        "1", "--json", str(out)], capture_output=True, text=True, env=env, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = orjson.loads(out.read_bytes())
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 8 * 4096
    assert summary["tokens_per_s"] > 0
    assert 1.0 <= summary["imbalance"] <= summary["naive_imbalance"] * 1.5
    assert set(summary["mixture"]) == {"web", "code", "long"}
    for m in summary["mixture"].values():
        assert abs(m["actual"] - m["target"]) < 0.05
    _run_the_printed_commands(r.stdout, tmp_path, env)


def _run_the_printed_commands(output: str, tmp_path, env: dict) -> None:
    """A new user runs the demo's job by hand with the three commands it printed (a free port
    instead of 5555, a few steps of the DDP trainer)."""
    import time

    commands = [line.strip() for line in output.splitlines()
                if any(w in line for w in (" coordinator --config ", " worker --coordinator ", "train_tiny.py "))]
    assert len(commands) == 3, output
    port = free_port()
    fix = lambda c: (c.replace("5555", str(port)).replace("/tmp/msd-demo-state", str(tmp_path / "state"))  # noqa: E731
                     .split("   #")[0].replace("--steps 50", "--steps 3").split())
    coordinator, worker, trainer = (fix(c) for c in commands)
    assert coordinator[0].endswith("msd") and coordinator[1] == "coordinator" and worker[1] == "worker"
    assert os.path.isfile(coordinator[coordinator.index("--config") + 1]), "the job file is left on disk"
    procs = [subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for c in (coordinator, worker)]
    try:
        time.sleep(1.0)
        done = subprocess.run(trainer + ["--port", str(free_port())], capture_output=True,
                              text=True, timeout=240, env={**env, "PYTHONPATH": os.getcwd()})
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "step 2: loss" in done.stdout
    finally:
        stop(procs)


def test_the_example_job_file_validates_as_written():
    """Tried as a new user: `msd validate configs/example.yaml`, as the file's first line says."""
    import os

    from click.testing import CliRunner

    from msd.cli import main as msd

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = CliRunner().invoke(msd, ["validate", os.path.join(root, "configs", "example.yaml")])
    assert r.exit_code == 0, r.output
    assert "OK: 2 sources" in r.output
