"""DataClient inside torch.distributed.checkpoint with two data-parallel ranks (gloo, two
processes): each rank's state comes back to that rank, and the resumed stream continues exactly."""

import os

import pytest

from msd.testing.local import LocalJob
from msd.testing.ports import free_port
from tests.conftest import job_dict, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _rank(rank: int, address: str, ckpt: str, port: int, out) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from trainer_client import DataClient
    from trainer_client.checkpoint import DataClientState

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    keys = lambda b: (b["step"], b["micro_batch"], b["doc_keys"].tolist())  # noqa: E731
    with DataClient(address, rank=rank, timeout_s=60) as client:
        first = [keys(next(client)) for _ in range(3)]  # inside step 1 (2 micro-batches a step)
        saved = client.state_dict()
        dcp.save({"data": DataClientState(client)}, checkpoint_id=ckpt)
        after = [keys(next(client)) for _ in range(4)]
    dist.barrier()  # the ranks resume together, as a training job does
    with DataClient(address, rank=rank, timeout_s=60) as resumed:
        dcp.load({"data": DataClientState(resumed)}, checkpoint_id=ckpt)
        loaded = resumed.state_dict()
        again = [keys(next(resumed)) for _ in range(4)]
    out.put((rank, saved, loaded, after, again, first))
    dist.destroy_process_group()


def test_each_rank_gets_its_own_state_back_through_dcp(dataset_dir, tmp_path):
    import multiprocessing as mp

    path = write_job(dataset_dir, job_dict(), "dcp.yaml")
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with LocalJob(path, workers=2) as job:
        procs = [ctx.Process(target=_rank, args=(r, job.address, str(tmp_path / "ckpt"), port, out)) for r in range(2)]
        for p in procs:
            p.start()
        results = {}
        for _ in procs:
            rank, saved, loaded, after, again, first = out.get(timeout=180)
            results[rank] = (saved, loaded, after, again)
        for p in procs:
            p.join(30)
    for rank, (saved, loaded, after, again) in results.items():
        assert loaded == saved and loaded["rank"] == rank
        assert again == after  # the resumed client continues where the saved one stood
    assert results[0][1]["rank"] == 0 and results[1][1]["rank"] == 1  # neither state was deduplicated away
