"""The torchtitan adapter against torchtitan's own classes (the `torchtitan` extra): it is a
BaseDataLoader and a Stateful, yields (input_dict, labels) as torchtitan's trainer takes them,
keys its state by data-parallel rank, and a loader restored from that state continues the stream."""

import threading

import pytest
import torch

from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from trainer_client import DataClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_msd_data_loader_is_a_torchtitan_data_loader(dataset_dir):
    from torch.distributed.checkpoint.stateful import Stateful
    from torchtitan.components.dataloader import BaseDataLoader

    from trainer_client.torchtitan import IGNORE_INDEX, MsdDataLoader

    path = write_job(dataset_dir, job_dict(), "titan.yaml")
    results: dict[int, tuple] = {}

    both_stopped = threading.Barrier(2)

    def rank(r: int, address: str) -> None:
        with DataClient(address, rank=r, timeout_s=60) as client:
            loader = MsdDataLoader(client, dp_rank=r, dp_world_size=2)
            assert isinstance(loader, BaseDataLoader) and isinstance(loader, Stateful)
            it = iter(loader)
            first = [next(it) for _ in range(3)]
            state = loader.state_dict()
            after = [next(it)[0]["input"].clone() for _ in range(3)]
        # A job resumes all its ranks together: a rank resuming while another still trains ahead
        # rewinds the plan under it (the test hung one run in four when the threads drifted apart).
        both_stopped.wait(60)
        with DataClient(address, rank=r, timeout_s=60) as client:
            resumed = MsdDataLoader(client, dp_rank=r, dp_world_size=2)
            resumed.load_state_dict(state)
            it = iter(resumed)
            again = [next(it)[0]["input"] for _ in range(3)]
        results[r] = (first, state, after, again)

    with LocalJob(path, workers=2) as job:
        threads = [threading.Thread(target=rank, args=(r, job.address)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert set(results) == {0, 1}
    for r, (first, state, after, again) in results.items():
        input_dict, labels = first[0]
        assert input_dict["input"].dtype == torch.int64 and input_dict["input"].shape == labels.shape
        assert {"positions", "cu_seqlens", "loss_mask", "doc_keys"} <= set(input_dict)
        ignored = input_dict["loss_mask"] == 0
        assert ignored.any() and (labels[ignored] == IGNORE_INDEX).all() and (labels[~ignored] >= 0).all()
        assert set(state) == {f"dp_rank_{r}", "world_size"} and state["world_size"] == 2
        assert all(torch.equal(a, b) for a, b in zip(after, again))  # the restored loader continues
