"""DataClient's checkpoint through the common save/load check (tests/resume_harness.py), against a
live job: resume after any micro-batch (mid-step too), and twice, gives the uninterrupted stream."""

import json

import pytest

from msd.testing.local import LocalJob
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


def test_a_coordinator_without_its_state_dir_resumes_from_the_ranks_checkpoints(dataset_dir):
    """The head node's disk is lost: a new coordinator with no state dir resumes exactly where the
    trainers' checkpoints say, from the coordinator state they carry."""
    from .harness import run_ranks, signature

    path = write_job(dataset_dir, job_dict(), "carried.yaml")
    with LocalJob(path, workers=2) as job:
        reference, _ = run_ranks(job, ranks=2, steps=16)
    with LocalJob(path, workers=2) as job:
        first, states = run_ranks(job, ranks=2, steps=9)
    states = {r: json.loads(json.dumps(s)) for r, s in states.items()}  # as a checkpoint stores them
    assert all(s["next_step"] == 9 and s["coordinator"]["planner"]["next_step"] == 9 for s in states.values())
    assert len(json.dumps(states[0]["coordinator"])) < 4096
    with LocalJob(path, workers=2) as job:  # a new coordinator: no state dir, nothing of the first run
        rest, _ = run_ranks(job, ranks=2, steps=16, resume=states)
    resumed = {r: first[r] + rest[r] for r in first}
    assert min(b["step"] for b in rest[0]) == 9
    assert signature(resumed) == signature(reference)

    # ranks that disagree (checkpoints of different steps' states under one step) are refused
    other = {r: json.loads(json.dumps(s)) for r, s in states.items()}
    other[1]["coordinator"]["planner"]["cursors"][0] += 1
    with LocalJob(path, workers=2) as job:
        with pytest.raises(AssertionError, match="differs from the one the first rank brought"):
            run_ranks(job, ranks=2, steps=16, resume=other, timeout_s=30)


def test_a_job_whose_data_moved_resumes_from_the_ranks_checkpoints(dataset_dir, tmp_path):
    """Issue 61: the job's digest held its data's absolute paths, so the same job and data under
    another mount point (a new cluster, a restored bucket) was another job, and the trainers'
    checkpoints were refused. The digest is the data's identity; the resume is exact."""
    import shutil

    from msd_common.spec import load_job

    from .harness import run_ranks, signature

    moved = str(tmp_path / "elsewhere" / "data")
    shutil.copytree(dataset_dir, moved, ignore=shutil.ignore_patterns("*.msdidx*", "*.msd.*", "*.yaml"))
    here, there = write_job(dataset_dir, job_dict(), "moved.yaml"), write_job(moved, job_dict(), "moved.yaml")
    assert load_job(here).digest() == load_job(there).digest()
    assert load_job(here).digest_before_0_4() != load_job(there).digest_before_0_4()  # 0.3.0's: by path
    with LocalJob(here, workers=2) as job:
        reference, _ = run_ranks(job, ranks=2, steps=10)
    with LocalJob(here, workers=2) as job:
        first, states = run_ranks(job, ranks=2, steps=5)
    states = {r: json.loads(json.dumps(s)) for r, s in states.items()}  # as a checkpoint stores them
    with LocalJob(there, workers=2) as job:  # the data at its new place, a new coordinator with nothing
        rest, _ = run_ranks(job, ranks=2, steps=10, resume=states)
    assert min(b["step"] for b in rest[0]) == 5
    assert signature({r: first[r] + rest[r] for r in first}) == signature(reference)
