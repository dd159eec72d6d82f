"""coordinator/evaluation.py without processes: the layout of a set and the pass of an empty one."""

import numpy as np

from coordinator import evaluation
from msd_common import protocol as P
from msd_common.spec import parse_job
from coordinator.holdout import Holdout, record_hash
from tests.conftest import job_dict


def _job(dataset_dir, eval_sets):
    job = job_dict(batch={"seq_len": 64, "micro_batch_size": 2, "global_batch_size": 8})
    job["eval"] = eval_sets
    return parse_job(job, "job.yaml", base_dir=dataset_dir)


def test_the_layout_holds_every_token_once_with_the_same_rows_per_rank(dataset_dir):
    job = _job(dataset_dir, {"h": {"holdout": {"web": 0.2}}})
    rng = np.random.default_rng(0)
    sources = np.zeros(40, np.int64)
    records = np.arange(40)
    lengths = rng.integers(0, 300, 40)  # some skipped (0), some longer than a row (cut: web is concat)
    layout, micro_batches = evaluation.layout(job, job.eval_sets[0], sources, records, lengths, dp=2)
    seen = {}
    for d, (refs, counts, idx) in layout.items():
        assert len(counts) == micro_batches * 2  # rows per rank: the same on both
        for (key, off, n), i in zip(refs.tolist(), idx.tolist()):
            seen.setdefault(i, []).append((off, n))
    for i, n in enumerate(lengths.tolist()):
        spans = sorted(seen.get(i, []))
        assert sum(m for _, m in spans) == n
        assert all(m <= 64 for _, m in spans)


def test_holdout_ranges_are_disjoint_and_a_count_is_exact():
    h = Holdout(7, [1000, 50], [{0: 0.1, 1: 5}, {0: 30}])
    a, b = h.records(0, 0), h.records(1, 0)
    assert len(b) == 30 and not set(a) & set(b)
    assert 60 <= len(a) <= 140
    assert len(h.records(0, 1)) == 5
    held = h.held_out(0, np.arange(1000))
    assert set(np.flatnonzero(held)) == set(a) | set(b)
    assert (record_hash(7, 0, np.arange(5)) == record_hash(7, 0, np.arange(5))).all()


def test_an_empty_set_is_served_as_a_pass_of_padding(dataset_dir):
    job = _job(dataset_dir, {"h": {"holdout": {"web": 1e-12}}})
    trainers = {0: type("T", (), {"address": "tcp://x"})(), 1: type("T", (), {"address": "tcp://y"})()}
    book = evaluation.EvalBook(job, Holdout(job.seed, [100, 40, 10], [dict(e.holdout) for e in job.eval_sets]),
                               [100, 40, 10], job.topology, lambda: {}, lambda: trainers)
    assert len(book.sets[0].records) == 0
    [send] = book.request(0, "h", 0, b"r0")  # the book returns what to send
    header = send.message
    assert send.peer == b"r0" and isinstance(header, P.EvalHeader) and header.reason == ""
    assert len(header.pieces) == 0 and len(header.counts) == 2  # one micro-batch of 2 rows, all padding
    [refusal] = book.request(0, "nope", 0, b"r0")
    assert "no eval set 'nope'" in refusal.message.reason
