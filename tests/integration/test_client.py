"""The trainer client against a live job: refusals, checkpoint state, and a hostile data socket."""

import msgpack
import numpy as np
import pytest
import zmq

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from trainer_client import DataClient, PeerLostError, RejectedError
from msd_common import protocol as P
from msd_common import wire

from .harness import check_content

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def job_path(dataset_dir):
    return write_job(dataset_dir, job_dict(topology={"dp": 1}, batch={"seq_len": 256, "micro_batch_size": 1,
                                                                       "global_batch_size": 2}), "client.yaml")


def test_rank_beyond_dp_is_refused(job_path):
    with LocalJob(job_path, workers=1) as job:
        client = DataClient(job.address, rank=3, as_torch=False, timeout_s=30)
        try:
            with pytest.raises(RejectedError, match="rank 3 out of range"):
                next(client)
        finally:
            client.close()


def test_state_dict_is_small_json_and_round_trips(job_path):
    with LocalJob(job_path, workers=1) as job:
        client = DataClient(job.address, rank=0, as_torch=False, timeout_s=30)
        try:
            for _ in range(5):
                batch = next(client)
            state = client.state_dict()
        finally:
            client.close()
    assert state["next_step"] == 2 and state["next_micro_batch"] == 1  # 2 micro-batches per step
    assert batch["step"] == 2 and batch["micro_batch"] == 0
    import json

    assert json.loads(json.dumps(state)) == state
    fresh = DataClient("tcp://127.0.0.1:1", rank=0)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    fresh.close()


def test_torch_tensors_by_default(job_path):
    import torch

    with LocalJob(job_path, workers=1) as job:
        with DataClient(job.address, rank=0, timeout_s=30) as client:
            batch = next(client)
    assert batch["tokens"].dtype == torch.int64 and batch["loss_mask"].dtype == torch.float32
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["doc_keys"].dtype == torch.int64
    assert batch["plan"]["max_over_mean"] >= 1.0


def test_a_new_users_ddp_loop_works_with_the_batches(job_path):
    """As tried by a new user writing a DDP trainer: decode doc_keys as README says, size the
    gradient accumulation loop before the first batch, move a batch to the device in one call,
    and checkpoint the client as a torch.distributed.checkpoint Stateful."""
    import torch
    from torch.distributed.checkpoint.stateful import Stateful

    from msd_common.spec import load_job

    job = load_job(job_path)
    with LocalJob(job_path, workers=1) as cluster:
        with DataClient(cluster.address, rank=0, timeout_s=30) as client:
            assert isinstance(client, Stateful)
            assert client.micro_batches_per_step == job.micro_batches_per_rank  # before any batch
            assert client.batch_shape["seq_len"] == job.batch.seq_len
            batch = next(client)
    sources = batch["doc_keys"] >> 48  # raised NotImplementedError on uint64
    assert torch.isin(sources, torch.tensor([0, 1, 2])).all()
    moved = batch.to("cpu", non_blocking=True)
    assert moved["tokens"].device.type == "cpu" and moved["step"] == batch["step"]
    assert moved["plan"] == batch["plan"] and type(moved["num_tokens"]) is int
    assert set(moved) == set(batch)


def test_data_socket_drops_malformed_messages_and_keeps_serving(job_path):
    with LocalJob(job_path, workers=1) as job:
        client = DataClient(job.address, rank=0, as_torch=False, timeout_s=30)
        received = {0: [next(client)]}
        ctx = zmq.Context()
        rogue = ctx.socket(zmq.PUSH)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(client.data_address)
        no_patches = (np.zeros(0, "<u4"), np.zeros(0, "|u1"), np.zeros(0, "|u1"),  # no patches, no mask, no extras
                      np.zeros(0, "<u4"))
        good_header = P.make(P.Pieces, step=1, rank=0, dtype="<u2", patch_bytes=0, extras=[])
        bad = [
            [b"garbage"],
            [msgpack.packb({"type": "pieces"})],
            [msgpack.packb({"type": "prepare", "task_id": 1, "source": 0}), b""],  # wrong socket
            wire.encode(good_header, np.array([[0, 5, 0, 3]], "<u8"), np.zeros(2, "<u2"), *no_patches),  # 3 != 2 tokens
            wire.encode(P.make(P.Pieces, step=1, rank=9, dtype="<u2", patch_bytes=0, extras=[]), np.array([[0, 5, 0,
                                                                                                            2]], "<u8"),
                        np.zeros(2, "<u2"), *no_patches),  # another rank's pieces
            wire.encode(P.make(P.Pieces, step=10**9, rank=0, dtype="<u2", patch_bytes=0, extras=[]), np.array([[0, 5,
                                                                                                                0, 2]],
                                                                                                                "<u8"),
                        np.zeros(2, "<u2"), *no_patches),  # absurdly far ahead
        ]
        try:
            for _ in range(50):
                for frames in bad:
                    rogue.send_multipart(frames)
            for _ in range(10):
                received[0].append(next(client))
        finally:
            rogue.close()
            ctx.term()
            client.close()
    assert check_content(job_path, received) >= 11
    assert [b["step"] for b in received[0][:3]] == [0, 0, 1]


def test_resume_where_the_plan_does_not_stand_is_refused_clearly(job_path):
    with LocalJob(job_path, workers=1) as job:
        client = DataClient(job.address, rank=0, as_torch=False, timeout_s=30)
        client.load_state_dict({"version": 1, "rank": 0, "next_step": 5, "next_micro_batch": 0,
                                "plan_digest": None})
        try:
            with pytest.raises(RejectedError, match="cannot resume at step 5"):
                next(client)
        finally:
            client.close()


def test_a_second_client_for_a_live_rank_gets_nothing_until_the_first_leaves(job_path):
    with LocalJob(job_path, workers=1) as job:
        first = DataClient(job.address, rank=0, as_torch=False, timeout_s=30)
        second = DataClient(job.address, rank=0, as_torch=False, timeout_s=3)
        try:
            got = [next(first) for _ in range(3)]
            with pytest.raises(PeerLostError, match="no welcome .*it answered: rank 0 is held by a live client"):
                next(second)  # refused while the first is alive: no data at all, and the error says why
            assert second.state_dict()["next_step"] == 0
            first.close()  # the rank is free: the second takes it over, from its own step 0
            second.timeout_s = 30
            again = next(second)
        finally:
            first.close()
            second.close()
    assert [b["step"] for b in got] == [0, 0, 1]
    assert again["step"] == 0 and np.array_equal(again["tokens"], got[0]["tokens"])


_FREED_HEAP = """
import sys
from trainer_client import DataClient
def anon_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon"))
from msd_common.memory import keep_freed_memory
keep_freed_memory()  # as a client does: freed heap stays resident
blocks = [bytearray(3000) for _ in range(4000)]  # 12 MB of heap, then 11 of it freed in holes
kept = blocks[::12]
del blocks
before = anon_kb()
client = DataClient(sys.argv[1], rank=0, as_torch=False, timeout_s=30, keep_freed_memory=sys.argv[2] == "1")
client.start()
print(before - anon_kb())
client.close()
"""


@pytest.mark.parametrize("keep", [True, False])
def test_a_starting_client_gives_back_the_free_heap_pages_once(job_path, keep):
    import subprocess
    import sys

    with LocalJob(job_path, workers=1) as job:
        out = subprocess.run([sys.executable, "-c", _FREED_HEAP, job.address, str(int(keep))], capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    given_back_kb = int(out.stdout.split()[-1])
    if keep:  # the holes went back to the OS (the client's own allocations are far smaller)
        assert given_back_kb > 6_000, given_back_kb
    else:  # keep_freed_memory=False: the client leaves the process's malloc alone
        assert given_back_kb < 2_000, given_back_kb
