"""DataClient's checkpoint through the common save/load check (tests/resume_harness.py), against a
live job: resume after any micro-batch (mid-step too), and twice, gives the uninterrupted stream."""

import json

import pytest

from coordinator.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from tests.resume_harness import check_save_load
from trainer_client import DataClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _item(batch):
    return (batch["step"], batch["micro_batch"], batch["doc_keys"].tolist(), batch["doc_offsets"].tolist(),
            batch["piece_lengths"].tolist(), batch["tokens"].tolist())


def test_data_client_resumes_after_any_micro_batch_and_twice(dataset_dir):
    path = write_job(dataset_dir, job_dict(topology={"dp": 1}, batch={"seq_len": 256, "micro_batch_size": 1,
                                                                       "global_batch_size": 3}), "resume.yaml")
    with LocalJob(path, workers=2) as job:

        def run(state, n):
            items, states = [], []
            with DataClient(job.address, rank=0, as_torch=False, timeout_s=60) as client:
                if state is not None:
                    client.load_state_dict(state)
                    assert client.state_dict() == state  # load then save gives it back
                for _ in range(n):
                    items.append(_item(next(client)))
                    states.append(json.loads(json.dumps(client.state_dict())))  # as a checkpoint stores it
            return items, states

        # 3 micro-batches a step: item 4 ends inside step 1, item 8 ends step 2
        reference = check_save_load(run, total=18, resume_at=[4, 8], twice=(1, 10))
    assert [s for s, m, *_ in reference] == [k // 3 for k in range(18)]
