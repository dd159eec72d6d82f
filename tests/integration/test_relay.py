"""Relays (`msd relay`, one per trainer host) with real processes on loopback: the ranks behind
them get exactly the stream of the direct path, a piece their host's ranks share crosses once, a
relay killed and started again loses nothing, and one that does not come back is named."""

import queue
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import job_dict, write_job
from msd.testing.local import LocalJob
from msd.testing.processes import stop

from .harness import run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 8
# dp=2 x tp=2, every rank receiving: ranks 0 and 1 are DP rank 0, ranks 2 and 3 DP rank 1
TOPOLOGY = {"dp": 2, "tp": 2, "delivery": "all"}


def start_relay(address: str, local: str, log: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "msd.cli", "relay", "--coordinator", address, "--local", local],
                            stderr=open(log, "ab"))


def _job(dataset_dir: str) -> str:
    return write_job(dataset_dir, job_dict(topology=TOPOLOGY), "relay.yaml")


def _status(cluster: LocalJob) -> dict:
    from coordinator.control import ask
    from msd_common import protocol as P

    return ask(cluster.address, P.StatusRequest(), 5.0).status


@pytest.fixture(scope="module")
def direct(dataset_dir):
    with LocalJob(_job(dataset_dir), workers=1) as cluster:
        received, _ = run_ranks(cluster, ranks=4, steps=STEPS, timeout_s=120)
    return received


def _relays(tmp_path, n: int) -> list[str]:
    return [f"ipc://{tmp_path}/relay-{i}.sock" for i in range(n)]


def test_ranks_behind_relays_get_the_direct_stream(dataset_dir, direct, tmp_path):
    local = _relays(tmp_path, 2)
    with LocalJob(_job(dataset_dir), workers=1) as cluster:
        relays = [start_relay(cluster.address, e, str(tmp_path / f"relay-{i}.log")) for i, e in enumerate(local)]
        try:
            seen = {}

            def during(c, n):
                if not seen and n >= 40:  # of 64
                    seen.update(_status(c))

            received, _ = run_ranks(cluster, ranks=4, steps=STEPS, timeout_s=120, during=during, compute_s=0.1,
                                    relays={0: local[0], 1: local[0], 2: local[1], 3: local[1]})
        finally:
            stop(relays)
    assert signature(received) == signature(direct)
    for r in range(4):
        for got, want in zip(received[r], direct[r]):
            np.testing.assert_array_equal(got["tokens"], want["tokens"])
    # each relay holds both ranks of one DP rank; the coordinator sees two relays
    assert sorted(sorted(r["ranks"]) for r in seen["relays"]) == [[0, 1], [2, 3]], (seen["relays"], seen["consumed"])
    # a DP rank's pieces come in once and go out to its two local ranks
    assert all(r["bytes_in"] > 0 and r["bytes_out"] == 2 * r["bytes_in"] for r in seen["relays"]), seen["relays"]
    # what `msd status` shows of them: its log line and its view
    from coordinator.status_view import _plain, render, status_line

    assert "2 relay(s) for 4 rank(s)" in status_line(seen)
    view = _plain(render(seen))
    assert "relays" in view and "0-1" in view and "2-3" in view


def test_a_relay_killed_and_started_again_loses_nothing(dataset_dir, direct, tmp_path):
    local = _relays(tmp_path, 2)
    with LocalJob(_job(dataset_dir), workers=1) as cluster:
        logs = [str(tmp_path / f"relay-{i}.log") for i in range(2)]
        relays = [start_relay(cluster.address, e, log) for e, log in zip(local, logs)]
        killed = []

        def during(c, n):
            if not killed and n >= 12:  # a few steps in: SIGKILL, then its supervisor starts it again
                relays[0].send_signal(signal.SIGKILL)
                relays[0].wait()
                killed.append(time.monotonic())
                relays[0] = start_relay(c.address, local[0], logs[0])

        try:
            received, _ = run_ranks(cluster, ranks=4, steps=STEPS, timeout_s=120, during=during,
                                    relays={0: local[0], 1: local[0], 2: local[1], 3: local[1]})
        finally:
            stop(relays)
    assert killed
    assert signature(received) == signature(direct)  # nothing lost, nothing twice


def test_a_relay_that_does_not_come_back_is_named(dataset_dir, tmp_path):
    local = _relays(tmp_path, 1)[0]
    with LocalJob(_job(dataset_dir), workers=1) as cluster:
        relay = start_relay(cluster.address, local, str(tmp_path / "relay.log"))
        started = []

        def during(c, n):
            if not started and n >= 8:
                relay.send_signal(signal.SIGKILL)
                started.append(time.monotonic())

        try:
            with pytest.raises(AssertionError) as failed:
                run_ranks(cluster, ranks=4, steps=1000, timeout_s=120, during=during, relay_timeout_s=5.0,
                          relays={r: local for r in range(4)})
        finally:
            stop([relay])
    assert "PeerLostError" in str(failed.value) and local in str(failed.value)
    assert time.monotonic() - started[0] < 30


def _run_with_a_rank_restarted(cluster: LocalJob, ranks: int, steps: int, relays: dict[int, str], rank: int,
                               after: int, timeout_s: float = 120) -> tuple[dict, float]:
    """Ranks 0..ranks-1 to `steps`; once `after` micro-batches are in, rank `rank`'s process is killed
    and a new one started for it alone, from the start (no checkpoint), as torchrun's restart of one
    rank would. Returns what each rank's last process received, and the seconds from the new
    process's start to its first micro-batch."""
    from .harness import SPAWN, collect

    # One queue per process: a process SIGKILLed while it holds a shared queue's write lock
    # would leave every other rank's put blocked (the test then saw the ranks stop at step 3).
    outs: dict[int, object] = {}

    def start(r: int):
        outs[r] = SPAWN.Queue()
        p = SPAWN.Process(target=collect, args=(cluster.address, r, steps, outs[r], 0.05, None, "127.0.0.1",
                                                relays.get(r)))
        p.start()
        return p

    def next_message() -> tuple | None:
        for q in list(outs.values()):
            try:
                return q.get_nowait()
            except queue.Empty:
                continue
        time.sleep(0.02)
        return None

    procs = {r: start(r) for r in range(ranks)}
    received: dict[int, list] = {r: [] for r in range(ranks)}
    done, n, restarted_at, first_after = set(), 0, None, None
    deadline = time.monotonic() + timeout_s
    try:
        while len(done) < ranks:
            counts = {r: len(b) for r, b in received.items()}
            assert time.monotonic() < deadline, f"not done in {timeout_s}s: {counts}"
            message = next_message()
            if message is None:
                continue
            kind, r, payload = message
            assert kind != "error", f"rank {r}: {payload}"
            if kind == "done":
                done.add(r)
                continue
            if r == rank and restarted_at is not None and first_after is None and payload["received_at"] > restarted_at:
                first_after = payload["received_at"] - restarted_at
            n += 1
            received[r].append(payload)
            if n >= after and restarted_at is None:
                procs[rank].kill()
                procs[rank].join()
                received[rank] = []  # the new process receives its stream from the start
                restarted_at = time.time()
                procs[rank] = start(rank)  # with a queue of its own: the old one may be broken
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return received, first_after


@pytest.mark.parametrize("through_relay", [False, True], ids=["direct", "relay"])
def test_a_rank_restarted_alone_rejoins_without_waiting_for_a_timeout(dataset_dir, tmp_path, through_relay):
    # heartbeats 5 s apart: the old process would be taken for dead after 15 s of silence
    job = job_dict(topology=TOPOLOGY, runtime={"heartbeat_s": 5.0, "prepare_batch": 16, "lookahead_steps": 3})
    path = write_job(dataset_dir, job, "restart-alone.yaml")
    with LocalJob(path, workers=1) as cluster:
        reference, _ = run_ranks(cluster, ranks=4, steps=STEPS, timeout_s=120)
    local = _relays(tmp_path, 2)
    with LocalJob(path, workers=1) as cluster:
        relays = [start_relay(cluster.address, e, str(tmp_path / f"relay-{i}.log")) for i, e in enumerate(local)]
        try:
            routes = {0: local[0], 1: local[0], 2: local[1], 3: local[1]} if through_relay else {}
            received, first_after = _run_with_a_rank_restarted(cluster, 4, STEPS, routes, rank=1, after=12)
        finally:
            stop(relays)
    assert signature(received) == signature(reference)  # the restarted rank's stream from step 0, the rest's too
    assert first_after is not None and first_after < 8.0, first_after  # its spawn, a hello or two, a rewind


@pytest.mark.parametrize("how", ["restart", "standby"])
def test_relays_follow_a_restarted_coordinator_or_its_standby(dataset_dir, tmp_path, how):
    """The coordinator SIGKILLed and started again on its state dir, or its standby taking over:
    the relays register again (with the standby: they were given both addresses), their ranks
    say hello again through them, and the stream is the one without the fault."""
    job = job_dict(topology=TOPOLOGY, runtime={"heartbeat_s": 0.3, "prepare_batch": 16, "lookahead_steps": 3})
    path = write_job(dataset_dir, job, f"relay-{how}.yaml")
    steps = 20
    with LocalJob(path, workers=1) as cluster:
        reference, _ = run_ranks(cluster, ranks=4, steps=steps, timeout_s=120)
    local = _relays(tmp_path, 2)
    faults = []

    def fault(c, n):
        if n >= 24 and not faults:
            if how == "restart":
                c.restart_coordinator()
            else:
                c.coordinator.kill()
            faults.append(n)

    with LocalJob(path, workers=1, state_dir=str(tmp_path / "state"), standby=how == "standby") as cluster:
        relays = [start_relay(cluster.address, e, str(tmp_path / f"relay-{i}.log")) for i, e in enumerate(local)]
        try:
            received, _ = run_ranks(cluster, ranks=4, steps=steps, timeout_s=120, during=fault, compute_s=0.02,
                                    relays={0: local[0], 1: local[0], 2: local[1], 3: local[1]})
        finally:
            stop(relays)
    assert faults
    assert signature(received) == signature(reference)
    logs = "".join(open(tmp_path / f"relay-{i}.log").read() for i in range(2))
    assert logs.count("welcomed by the coordinator") >= 4  # each relay twice: before and after


def test_an_elastic_resume_on_another_number_of_hosts(dataset_dir, direct, tmp_path):
    """Four ranks on two hosts (two relays) to step 4, checkpointed; then the same ranks on one host
    (one relay), resumed from their checkpoints by a new coordinator: the stream goes on unchanged."""
    path = _job(dataset_dir)
    half = STEPS // 2
    local = _relays(tmp_path, 2)
    with LocalJob(path, workers=1, state_dir=str(tmp_path / "state")) as cluster:
        relays = [start_relay(cluster.address, e, str(tmp_path / f"relay-{i}.log")) for i, e in enumerate(local)]
        try:
            first, states = run_ranks(cluster, ranks=4, steps=half, timeout_s=120,
                                      relays={0: local[0], 1: local[0], 2: local[1], 3: local[1]})
        finally:
            stop(relays)
    assert all(s["next_step"] == half for s in states.values())
    one = f"ipc://{tmp_path}/one-host.sock"
    with LocalJob(path, workers=2, state_dir=str(tmp_path / "state")) as cluster:
        relay = start_relay(cluster.address, one, str(tmp_path / "one-host.log"))
        try:
            second, _ = run_ranks(cluster, ranks=4, steps=STEPS, timeout_s=120, resume=states,
                                  relays={r: one for r in range(4)})
        finally:
            stop([relay])
    both = {r: first[r] + second[r] for r in range(4)}
    assert signature(both) == signature(direct)


def test_a_relay_that_stops_cleanly_removes_its_ipc_socket(tmp_path):
    """Issue 61: a relay that exited cleanly left its ipc socket file behind in the temporary
    directory (one per relay start on a trainer host, never cleaned)."""
    import os

    from msd.testing.ports import free_address

    sock = tmp_path / "relay.sock"
    relay = start_relay(free_address(), f"ipc://{sock}", str(tmp_path / "relay.log"))
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            assert relay.poll() is None and time.monotonic() < deadline, open(tmp_path / "relay.log").read()
            time.sleep(0.05)
        relay.send_signal(signal.SIGTERM)
        assert relay.wait(30) == 0, open(tmp_path / "relay.log").read()
    finally:
        if relay.poll() is None:
            relay.kill()
    assert not os.path.exists(sock), "the relay left its ipc socket behind"
