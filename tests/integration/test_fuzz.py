"""10,000 random and mutated messages at a live coordinator and at a trainer client's data socket:
nothing crashes, bad messages are dropped with a logged reason, and the job is served normally."""

import msgpack
import numpy as np
import pytest
import zmq

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from trainer_client import DataClient
from msd_common import protocol as P
from msd_common import wire

from .harness import check_content

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MESSAGES = 10_000


def _valid_samples():
    """One well-formed message of each kind (for the mutator to start from)."""
    items = np.array([[0, 5, 0, 3]], "<u8")
    return [
        wire.encode(P.make(P.WorkerHeartbeat, worker_id=0, cached_records=3, busy_s=0.5, backlog=0, send_waits=0)),
        wire.encode(P.make(P.Prepared, worker_id=0, task_id=1, skipped=[], busy_s=0.1), np.array([3, 4], "<i8"),
                    np.zeros(0, "<i8"), np.zeros(0, "<i8"), np.array([0, 1 << 20], "<i8")),
        wire.encode(P.make(P.Delivered, worker_id=0, delivery_id=2, failed=[], unserved=0)),
        wire.encode(P.make(P.Consumed, rank=0, step=1, waited_s=0.0, compute_step=-1, compute_s=[], loss_step=-1,
                           loss_sources=[], loss_sums=[], loss_tokens=[])),
        wire.encode(P.make(P.TrainerHeartbeat, rank=0)),
        wire.encode(P.make(P.MixRequest, at_step=10**6, weights={"nope": 1.0})),
        wire.encode(P.make(P.Pieces, step=1, rank=0, dtype="<u2", patch_bytes=0, extras=[]), items,
                    np.zeros(3, "<u2"), np.zeros(0, "<u4"), np.zeros(0, "|u1"), np.zeros(0, "|u1"), np.zeros(0, "<u4")),
        wire.encode(P.make(P.HostHeartbeat, agent_id=1, procs=2, pids=[])),
        wire.encode(P.make(P.WorkerExited, agent_id=1, pid=2, exitcode=-9, task_id=3, source=-1, record=-1,
                           overran_s=0.0)),
        wire.encode(P.make(P.StateRequest, rank=0, step=1)),
        wire.encode(P.make(P.StepHeader, step=1, rank=0, row_len=8, plan={}), items[:, 1:], np.array([1], "<u4")),
    ]


def _mutate(rng, frames):
    frames = [bytes(f) for f in frames]
    kind = int(rng.integers(0, 8))
    if kind == 0:  # random bytes
        return [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 4)))]
    if kind == 1:  # flip bytes of one frame
        i = int(rng.integers(0, len(frames)))
        b = bytearray(frames[i])
        for _ in range(int(rng.integers(1, 4))):
            if b:
                b[int(rng.integers(0, len(b)))] = int(rng.integers(0, 256))
        frames[i] = bytes(b)
        return frames
    if kind == 2:  # truncate a frame
        i = int(rng.integers(0, len(frames)))
        frames[i] = frames[i][: int(rng.integers(0, max(1, len(frames[i]))))]
        return frames
    if kind == 3:  # drop or add frames
        return frames[:-1] if len(frames) > 1 and rng.random() < 0.5 else frames + [rng.bytes(8)]
    header = msgpack.unpackb(frames[0])
    key = list(header)[int(rng.integers(0, len(header)))]
    if kind == 4:  # a field of the wrong type
        header[key] = [None, "x", -1.5, [1, 2], {"a": 1}, -(2**40), b"raw"][int(rng.integers(0, 7))]
    elif kind == 5:  # a missing field
        del header[key]
    elif kind == 6:  # an extra field
        header["x" + str(int(rng.integers(0, 99)))] = 1
    else:  # a type this socket does not accept
        header["type"] = ["prepare", "deliver", "welcome", "shutdown", "nonsense", 7][int(rng.integers(0, 6))]
    try:
        frames[0] = msgpack.packb(header)
    except (TypeError, ValueError, OverflowError):
        frames[0] = b"\xc1"
    return frames


def test_fuzzed_coordinator_and_data_socket_keep_serving(dataset_dir, tmp_path, caplog):
    caplog.set_level("WARNING", logger="msd.client")
    path = write_job(dataset_dir, job_dict(topology={"dp": 1}, batch={"seq_len": 256, "micro_batch_size": 1,
                                                                       "global_batch_size": 2}), "fuzz.yaml")
    log = str(tmp_path / "fuzz.log")
    rng = np.random.default_rng(2026)
    samples = _valid_samples()
    with LocalJob(path, workers=1, log_path=log, log_level="INFO") as job:
        client = DataClient(job.address, rank=0, as_torch=False, timeout_s=60)
        received = {0: [next(client)]}
        ctx = zmq.Context()
        at_coordinator = ctx.socket(zmq.DEALER)
        at_client = ctx.socket(zmq.PUSH)
        for s in (at_coordinator, at_client):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 100_000)
        at_coordinator.connect(job.address)
        at_client.connect(client.data_address)
        try:
            for i in range(MESSAGES):
                frames = _mutate(rng, samples[int(rng.integers(0, len(samples)))])
                (at_coordinator if i % 2 else at_client).send_multipart(frames)
                if i % 1000 == 0:
                    received[0].append(next(client))  # served all along
            for _ in range(20):
                received[0].append(next(client))
            assert job.coordinator.is_alive() and all(p > 0 for p in job.worker_pids())
        finally:
            at_coordinator.close()
            at_client.close()
            ctx.term()
            client.close()
    assert check_content(path, received) >= 30
    steps = [(b["step"], b["micro_batch"]) for b in received[0]]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)  # in order, nothing twice
    with open(log) as f:
        text = f.read()
    assert text.count("dropped message from peer") + text.count("unregistered peer") > 1000
    client_drops = [r for r in caplog.records if "dropped data message" in r.getMessage()]
    assert len(client_drops) > 1000  # the data socket's bad messages, each with its reason
