"""The job's digest is its data's identity, not its data's place (issue 61), and what 0.3.0 wrote
under the digest it gave (with the data's absolute paths) is still this job's: a state dir's
journal and record, a trainer checkpoint's plan digest and carried state."""

from __future__ import annotations

import os
import shutil

import orjson
import pytest

from coordinator.journal import JournalFile
from coordinator.statedir import JOB_RECORD, check_job_change
from msd_common import protocol as P
from msd_common import wire
from msd_common.errors import RejectedError
from msd_common.spec import load_job, relative_files
from trainer_client.receiving import ReceivingState

JOB = """seed: 3
sources:
  web: {format: jsonl, paths: ["data/web/*.jsonl"], tokenizer: tok.json}
batch: {seq_len: 64, micro_batch_size: 1, global_batch_size: 2}
topology: {dp: 2}
mixture: {weights: {web: 1.0}}
"""


@pytest.fixture
def two_places(tmp_path):
    """The same job file and data under two directories."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = []
    for place in ("a", "b/deeper"):
        root = tmp_path / place
        (root / "data" / "web").mkdir(parents=True)
        for shard in range(2):
            (root / "data" / "web" / f"part-{shard}.jsonl").write_text('{"text": "hello there"}\n' * 20)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.add_special_tokens(["<|endoftext|>"])
        tok.save(str(root / "tok.json"))
        (root / "job.yaml").write_text(JOB)
        out.append(load_job(str(root / "job.yaml")))
    return out


def test_the_same_job_and_data_under_two_directories_have_one_digest(two_places):
    a, b = two_places
    assert a.sources[0].files != b.sources[0].files  # (absolute paths)
    assert a.digest() == b.digest()
    assert a.digest_before_0_4() != b.digest_before_0_4()  # 0.3.0 gave them two


def test_the_digest_still_tells_other_data_and_another_tokenizer_apart(two_places, tmp_path):
    a, _ = two_places
    root = os.path.dirname(a.path)
    os.rename(os.path.join(root, "data/web/part-1.jsonl"), os.path.join(root, "data/web/part-9.jsonl"))
    renamed = load_job(a.path).digest()
    assert renamed != a.digest()  # another file set
    with open(os.path.join(root, "tok.json"), "a") as f:
        f.write(" ")
    assert load_job(a.path).digest() != renamed  # another tokenizer (its content)


def test_files_are_named_relative_to_their_common_directory():
    assert relative_files(["/m/x/web/a.jsonl", "/m/x/web/sub/b.jsonl"]) == ["a.jsonl", "sub/b.jsonl"]
    assert relative_files(["s3://bucket/p/a.parquet", "s3://bucket/p/b.parquet"]) == ["a.parquet", "b.parquet"]
    assert relative_files(["/one/file.jsonl"]) == ["file.jsonl"]


def test_a_state_dir_of_0_3_0_is_this_jobs(two_places, tmp_path):
    a, _ = two_places
    state = str(tmp_path / "state")
    os.makedirs(state)
    with open(os.path.join(state, JOB_RECORD), "wb") as f:  # the record 0.3.0 wrote: absolute paths
        f.write(orjson.dumps({"stream": a.stream_definition(where=True), "topology": a.topology._asdict()}))
    assert check_job_change(state, a, allow=False) is False  # not a changed job
    from coordinator.plan import Planner

    initial = Planner(a, [40]).state.to_json()
    JournalFile(state, a.digest_before_0_4()).append([initial])  # a step journaled by 0.3.0
    assert len(JournalFile(state, a.digest(), (a.digest_before_0_4(),)).load()) == 1
    with pytest.raises(ValueError, match="the job file changed"):
        JournalFile(state, a.digest()).load()  # (without the earlier digest it would be refused)


def test_a_checkpoint_of_0_3_0_is_taken_by_the_client(tmp_path):
    welcome = P.TrainerWelcome(rank=0, batch={"micro_batch_size": 1, "micro_batches": 1, "pad_id": 0,
                                              "earlier_plan_digests": ["old"]}, plan_digest="new", heartbeat_s=1.0)
    state = ReceivingState(0, 5, 0, "old", False)
    assert not [x for x in state.on_control(wire.encode(welcome)) if isinstance(x, RejectedError)]
    assert state.plan_digest == "new"  # and its next checkpoint carries the new digest
    other = ReceivingState(0, 5, 0, "another", False)
    assert [x for x in other.on_control(wire.encode(welcome)) if isinstance(x, RejectedError)]


def test_a_copy_of_the_tree_keeps_its_digest(two_places, tmp_path):
    a, _ = two_places
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(a.path), copy, ignore=shutil.ignore_patterns("*.msdidx*"))
    assert load_job(str(copy / "job.yaml")).digest() == a.digest()
