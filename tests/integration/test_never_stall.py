"""Issue 57: never stall, with real processes. Tried as a new user would at 9bb899a:

- a sample that takes longer than three heartbeats (a video decode, a model called by a
  transform) made its worker look dead: it was declared dead, its work dropped, and it registered
  again, every time;
- SIGTERM to the coordinator ended every rank's `for batch in client:` as if the data ran out,
  even with a standby running;
- a SIGKILLed coordinator left the ranks silent until `no micro-batch for 300s`, which never said
  that the coordinator had stopped answering;
- a rank arriving after the job failed heard nothing and waited out its timeout.

Heartbeats are short here (0.2 s: a silent peer is dead after 0.6 s) and every slow sample is many
times longer."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from trainer_client import CoordinatorStoppedError, DataClient, JobFailedError, PeerLostError

from .harness import run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 20
HEARTBEAT_S = 0.2
SLOW_S = 1.5  # one sample: 7.5 heartbeats


@pytest.fixture(scope="module")
def quick_job(dataset_dir):
    job = job_dict(runtime={"heartbeat_s": HEARTBEAT_S, "prepare_batch": 8, "lookahead_steps": 3})
    job["batch"] = {"seq_len": 512, "micro_batch_size": 2, "global_batch_size": 4}
    path = write_job(dataset_dir, job, "never-stall.yaml")
    return path, run_job(path, workers=2, ranks=2, steps=STEPS)


def test_a_sample_many_heartbeats_long_never_makes_its_worker_look_dead(quick_job, tmp_path, monkeypatch):
    """Every 10th of the first 80 records of `web` takes 1.5 s in one piece (no keep-alive can
    run inside it): the agent vouches for the busy worker, so nothing is declared dead or prepared
    again, and the stream is the fault-free one."""
    path, clean = quick_job
    monkeypatch.setenv("MSD_TEST_SLOW_RECORDS", ",".join(f"web:{r}={SLOW_S}" for r in range(0, 80, 10)))
    log = str(tmp_path / "slow.log")
    slow = run_job(path, workers=2, ranks=2, steps=STEPS, log_path=log, timeout_s=180)
    assert signature(slow) == signature(clean)
    text = open(log).read()
    for words in ("declared dead", "re-preparing", "registering again"):
        assert words not in text, f"{words!r} in the log: a busy worker was taken for a dead one"


def test_a_transform_slow_on_every_8th_record_makes_30_steps_at_its_pace_and_no_worker_looks_dead(dataset_dir, tmp_path,
                                                                                                monkeypatch):
    """The trial: a transform that takes a while on every 8th record (here 1 s: five heartbeats,
    in one piece). 30 steps come at the pace the slow records allow, equal to the same job's
    stream without the sleep, and no worker is declared dead or registers again."""
    job = job_dict(runtime={"heartbeat_s": HEARTBEAT_S, "prepare_batch": 8, "lookahead_steps": 3})
    job["sources"]["web"]["transform"] = "msd.testing.transforms:slow_every"
    job["batch"] = {"seq_len": 512, "micro_batch_size": 2, "global_batch_size": 4}
    path = write_job(dataset_dir, job, "slow-transform.yaml")
    fast = run_job(path, workers=2, ranks=2, steps=30)
    monkeypatch.setenv("MSD_TEST_SLOW_TRANSFORM_S", "1.0")
    log = str(tmp_path / "slow-transform.log")
    started = time.monotonic()
    slow = run_job(path, workers=2, ranks=2, steps=30, log_path=log, timeout_s=240)
    took = time.monotonic() - started
    assert signature(slow) == signature(fast)
    slow_records = {k & ((1 << 48) - 1) for bs in slow.values() for b in bs for k in b["doc_keys"].tolist()
                    if k >> 48 == 0 and (k & ((1 << 48) - 1)) % 8 == 0}
    print(f"30 steps in {took:.1f}s with {len(slow_records)} slow records of 1 s in the stream")
    assert slow_records and took > len(slow_records) / 2, "the slow records were not slow"
    text = open(log).read()
    for words in ("declared dead", "re-preparing", "registering again"):
        assert words not in text, f"{words!r} in the log: a busy worker was taken for a dead one"


def test_a_sample_past_max_sample_s_is_poison_its_record_quarantined_and_the_job_goes_on(dataset_dir, tmp_path,
                                                                                       monkeypatch):
    job = job_dict(runtime={"heartbeat_s": HEARTBEAT_S, "prepare_batch": 8, "lookahead_steps": 3})
    job["sources"]["web"]["max_sample_s"] = 1.0
    path = write_job(dataset_dir, job, "max-sample.yaml")
    monkeypatch.setenv("MSD_TEST_SLOW_RECORDS", "web:3=60")  # stuck
    log = str(tmp_path / "stuck.log")
    started = time.monotonic()
    run_job(path, workers=2, ranks=2, steps=10, log_path=log, timeout_s=120)
    assert time.monotonic() - started < 60, "the stuck sample held the job"
    text = open(log).read()
    assert "record 3 quarantined: its sample took longer than max_sample_s (1s)" in text, text[-3000:]
    assert "ran past the source's max_sample_s; stopping the process" in text


def _rank(address: str, rank: int, out: dict, started: float, **kwargs) -> None:
    """A trainer rank in a thread: every micro-batch's arrival, then how its loop ended."""
    client = DataClient(address, rank=rank, as_torch=False, timeout_s=120, **kwargs)
    got = out.setdefault(rank, {"batches": [], "end": None})
    try:
        for batch in client:
            got["batches"].append((batch["step"], batch["micro_batch"], time.monotonic() - started,
                                   tuple(batch["doc_keys"].tolist())))
            time.sleep(0.05)
        got["end"] = (time.monotonic() - started, StopIteration())
    except BaseException as e:  # noqa: BLE001 - what the trainer would see
        got["end"] = (time.monotonic() - started, e)
    finally:
        client.close()


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_sigterm_with_a_standby_hands_over_and_the_stream_goes_on_equal(quick_job, tmp_path):
    """The serving coordinator gives its lease up at once on SIGTERM: the standby serves the same
    stream, faster than after a crash (SIGKILL: 3 heartbeats of a lease not renewed, then the
    takeover); no rank's loop ends."""
    path, clean = quick_job
    stopped: list[float] = []

    def sigterm_primary(cluster, n_batches):
        if n_batches >= 12 and not stopped:
            os.kill(cluster.coordinator.pid, signal.SIGTERM)
            stopped.append(time.time())

    log = str(tmp_path / "handover.log")
    with LocalJob(path, workers=2, log_path=log, log_level="INFO", state_dir=str(tmp_path / "state"),
                  standby=True) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=STEPS, during=sigterm_primary, timeout_s=120)
    assert stopped
    assert signature(received) == signature(clean)
    text = open(log).read()
    assert "with token 2" in text and "was not renewed" not in text, "taken over as released, not as stale"
    gaps = [b - a for batches in received.values() for a, b in
            zip(*(lambda at: (at, at[1:]))(sorted(x["received_at"] for x in batches))) if b > stopped[0]]
    print(f"SIGTERM handover: longest wait for a batch after the SIGTERM {max(gaps):.2f}s "
          f"(heartbeat {HEARTBEAT_S}s)")
    assert max(gaps) < 10 * HEARTBEAT_S + 3.0


def _ranks_then(path: str, log: str, stop_coordinator, **client_kwargs) -> tuple[dict, float]:
    """Two ranks in threads on a job without a standby; once each has 3 micro-batches,
    stop_coordinator(cluster); then until both loops end. (How each ended, the stop's time.)"""
    out: dict = {}
    with LocalJob(path, workers=2, log_path=log, log_level="INFO") as cluster:
        started = time.monotonic()
        threads = [threading.Thread(target=_rank, args=(cluster.address, r, out, started), kwargs=client_kwargs)
                   for r in (0, 1)]
        for t in threads:
            t.start()
        _wait_for(lambda: all(len(out.get(r, {}).get("batches", ())) >= 3 for r in (0, 1)), 60, "no batches")
        stop_coordinator(cluster)
        stopped = time.monotonic() - started
        for t in threads:
            t.join(30)
    return out, stopped


def test_sigterm_without_a_standby_makes_every_rank_raise_naming_the_stop(quick_job, tmp_path):
    out, stopped = _ranks_then(quick_job[0], str(tmp_path / "stop.log"),
                               lambda cluster: os.kill(cluster.coordinator.pid, signal.SIGTERM), stop_grace_s=3.0)
    for r in (0, 1):
        at, error = out[r]["end"]
        assert isinstance(error, CoordinatorStoppedError), (r, error)
        assert "the coordinator stopped (coordinator stopping)" in str(error), str(error)
        assert at - stopped < 3.0 + 3.0, (r, at - stopped)


def test_a_killed_coordinator_without_a_standby_is_named_within_a_few_heartbeats(quick_job, tmp_path, caplog):
    with caplog.at_level("WARNING", logger="msd.client"):
        out, killed = _ranks_then(quick_job[0], str(tmp_path / "kill.log"), lambda cluster: cluster.coordinator.kill(),
                                  coordinator_timeout_s=3.0)
    for r in (0, 1):
        at, error = out[r]["end"]
        assert isinstance(error, PeerLostError) and not isinstance(error, CoordinatorStoppedError), (r, error)
        assert "has not answered for" in str(error), str(error)
        assert at - killed < 3.0 + 3.0, (r, at - killed)
    assert any("has not answered for" in m and "waiting for it" in m for m in caplog.messages)


def test_a_rank_arriving_after_the_job_failed_raises_the_reason_within_seconds(dataset_dir, tmp_path):
    """The failed coordinator keeps its address (runtime.failed_linger_s) and answers the late
    rank's hello with the reason; msd status shows the failure while it lingers."""
    (tmp_path / "failing_now.py").write_text("def f(record, ctx):\n    return record['no_such_field']\n")
    job = job_dict(runtime={"heartbeat_s": HEARTBEAT_S})
    job["sources"]["web"].update(transform="failing_now:f", max_transform_errors=5)
    job["sources"] = {k: {**v, "paths": [f"{dataset_dir}/{v['paths'][0]}"]} for k, v in job["sources"].items()}
    path = write_job(str(tmp_path), job)
    log = str(tmp_path / "failed.log")
    sys.path.insert(0, str(tmp_path))
    try:
        with LocalJob(path, workers=1, log_path=log, log_level="INFO") as cluster:
            _wait_for(lambda: os.path.exists(log) and "answering every peer with the reason" in open(log).read(),
                      60, "the job did not fail")
            started = time.monotonic()
            client = DataClient(cluster.address, rank=0, as_torch=False, timeout_s=120)
            try:
                with pytest.raises(JobFailedError, match="5 consecutive records failed in transform failing_now:f"):
                    next(iter(client))
            finally:
                client.close()
            assert time.monotonic() - started < 5.0
            from coordinator.status_view import fetch_status

            assert "5 consecutive records failed" in fetch_status(cluster.address)["failed"]
            assert cluster.coordinator.is_alive(), "it lingers (runtime.failed_linger_s) until stopped"
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("failing_now", None)


def test_a_lingering_coordinator_answers_every_hello_with_the_reason_and_status_with_the_failure():
    """coordinator/linger.py on a real ROUTER: a rank's, a worker's and a relay's hello each get
    job_failed with the reason (once a second per peer at most), a status request the status with
    the failure, and the health beat goes on (the process is alive; /readyz says failed)."""
    import asyncio

    import zmq

    from coordinator.linger import linger
    from msd.testing.ports import free_address
    from msd_common import protocol as P
    from msd_common import wire
    from msd_common.sockets import make_socket

    address = free_address()
    ctx = zmq.Context()
    router = make_socket(ctx, zmq.ROUTER)
    router.bind(address)
    beats = []
    hellos = [
        P.make(P.TrainerHello, version=P.PROTOCOL_VERSION, rank=0, data_address="tcp://x:1", resume_step=0,
               incarnation=1, metadata_only=0, carried=None),
        P.make(P.WorkerHello, version=P.PROTOCOL_VERSION, host="h", pid=1, incarnation=1, agent=0),
        P.make(P.RelayHello, version=P.PROTOCOL_VERSION, host="h", data_address="tcp://x:2", local="ipc://x",
               incarnation=1),
    ]
    answers: list[dict] = []

    def peers() -> None:
        socks = [make_socket(ctx, zmq.DEALER) for _ in range(len(hellos) + 1)]
        try:
            for sock, hello in zip(socks, hellos):
                sock.connect(address)
                sock.send_multipart(wire.encode(hello))
                sock.send_multipart(wire.encode(hello))  # a second, at once: not answered twice
            socks[-1].connect(address)
            socks[-1].send_multipart(wire.encode(P.make(P.StatusRequest)))
            for sock in socks:
                assert sock.poll(5000), "no answer"
                answers.append(wire.decode(sock.recv_multipart(), P.TRAINER_CONTROL_INBOX | P.TOOL_INBOX)[0])
            for sock in socks[:-1]:
                assert not sock.poll(300), "answered twice within a second"
        finally:
            for sock in socks:
                sock.close(linger=0)

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.ensure_future(linger(router, "source 'web': it broke", 30.0,
                                            lambda: {"failed": "source 'web': it broke"}, stop,
                                            lambda: beats.append(1)))
        await asyncio.to_thread(peers)
        stop.set()
        await asyncio.wait_for(task, 5)

    try:
        asyncio.run(main())
    finally:
        router.close(linger=0)
        ctx.term()
    assert [a["type"] for a in answers] == ["job_failed"] * 3 + ["status_reply"]
    assert all(a["reason"] == "source 'web': it broke" for a in answers[:3])
    assert answers[3]["status"]["failed"] == "source 'web': it broke"
    assert beats


def test_a_failed_coordinator_is_alive_not_ready_and_stops_on_sigterm(dataset_dir, tmp_path):
    """`msd coordinator` with --metrics-port, its job failing: while it lingers /readyz answers 503
    with role "failed" and /healthz 200 (a liveness probe must not restart it: it is telling peers
    why); SIGTERM ends the lingering at once, exit status 1."""
    import json
    import subprocess
    import urllib.error
    import urllib.request

    from msd.testing.ports import free_address, free_port
    from msd.testing.processes import msd_command

    (tmp_path / "failing_probe.py").write_text("def f(record, ctx):\n    return record['no_such_field']\n")
    job = job_dict(runtime={"heartbeat_s": HEARTBEAT_S})
    job["sources"]["web"].update(transform="failing_probe:f", max_transform_errors=5)
    job["sources"] = {k: {**v, "paths": [f"{dataset_dir}/{v['paths'][0]}"]} for k, v in job["sources"].items()}
    path = write_job(str(tmp_path), job)
    port, log = free_port(), tmp_path / "coordinator.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen([msd_command(), "coordinator", "--config", path, "--bind", free_address(),
                                 "--metrics-port", str(port), "--worker-procs", "1"], stdout=out,
                                stderr=subprocess.STDOUT, env=env)
    try:
        _wait_for(lambda: "answering every peer with the reason" in log.read_text(), 90, "the job did not fail")

        def probe(name: str) -> tuple[int, dict]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/{name}", timeout=5) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        assert probe("readyz") == (503, {"ready": False, "role": "failed"})
        time.sleep(2 * HEARTBEAT_S + 1)
        assert probe("healthz")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
