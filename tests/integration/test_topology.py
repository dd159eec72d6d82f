"""Hybrid-parallel delivery with real processes: a dp=2, cp=2, tp=2 job (8 trainer processes)
delivers exactly the batches of the dp=2 job, split by CP and repeated over TP."""

import numpy as np
import pytest

from tests.conftest import job_dict, write_job
from msd_common.topology import Topology

from .harness import run_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

STEPS = 6


def _by_step(batches):
    return {(b["step"], b["micro_batch"]): b for b in batches}


def test_dp2_cp2_tp2_reassembles_to_the_dp2_batches(dataset_dir):
    plain = run_job(write_job(dataset_dir, job_dict(), "dp2.yaml"), workers=1, ranks=2, steps=STEPS)
    topo = Topology(dp=2, cp=2, tp=2, delivery="all")
    hybrid_job = job_dict(topology={"dp": 2, "cp": 2, "tp": 2, "delivery": "all"})
    hybrid = run_job(write_job(dataset_dir, hybrid_job, "dp2cp2tp2.yaml"), workers=1, ranks=8, steps=STEPS,
                     timeout_s=240)
    for d in range(2):
        want = _by_step(plain[d])
        assert len(want) == STEPS * 2
        shares = {}
        for rank in range(8):
            c = topo.coords(rank)
            if c.dp != d:
                continue
            got = _by_step(hybrid[rank])
            assert got.keys() == want.keys()
            if c.tp == 1:  # TP ranks get identical batches
                twin = _by_step(hybrid[topo.rank_of(c._replace(tp=0))])
                for key in got:
                    for name in ("tokens", "labels", "position_ids", "cp_index"):
                        np.testing.assert_array_equal(got[key][name], twin[key][name])
                continue
            shares[c.cp] = got
        for key, full in want.items():
            for name in ("tokens", "labels", "position_ids", "loss_mask"):
                flat = np.asarray(full[name]).reshape(-1)
                rebuilt = np.full(flat.shape, -7, dtype=flat.dtype)
                covered = np.zeros(flat.shape, dtype=int)
                for cp_rank, got in shares.items():
                    part, index = np.asarray(got[key][name]).reshape(-1), got[key]["cp_index"]
                    real = index >= 0
                    rebuilt[index[real]] = part[real]
                    covered[index[real]] += 1
                assert (covered == 1).all(), (key, name)  # every position on exactly one CP rank
                np.testing.assert_array_equal(rebuilt, flat, err_msg=f"{key} {name}")
            for cp_rank, got in shares.items():
                b = got[key]
                np.testing.assert_array_equal(b["doc_keys"], full["doc_keys"])
                np.testing.assert_array_equal(b["doc_offsets"], full["doc_offsets"])
                # every CP rank holds an equal share of every (padded) segment
                assert np.all(np.diff(b["cp_cu_seqlens"]) * 2 == np.diff(b["cu_seqlens_padded"]))
                np.testing.assert_array_equal(b["cu_seqlens"], full["cu_seqlens"])


def test_topology_coordinates_follow_megatron_order():
    topo = Topology(dp=2, pp=2, cp=2, tp=2)
    assert [tuple(topo.coords(r)) for r in (0, 1, 2, 4, 8)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (1, 0, 0, 0), (0, 1, 0, 0)]
    assert all(topo.rank_of(topo.coords(r)) == r for r in range(16))
    first = topo.fields(0)  # first stage: the inputs (image patches too), and the packing metadata
    assert first[:2] == ("tokens", "position_ids") and "pixel_patches" in first and "cu_seqlens" in first
    assert "labels" not in first
    assert topo.fields(8)[:2] == ("labels", "loss_mask")  # last stage
    assert topo.fields(1) == ()  # tp_leader: only TP rank 0 receives
    assert topo.receivers() == [0, 2, 4, 6, 8, 10, 12, 14]
    three = Topology(dp=1, pp=3)
    assert three.fields(1) == () and three.fields(1, want_metadata=True)[0] == "cu_seqlens"


def test_pipeline_stages_get_their_fields(dataset_dir):
    plain = run_job(write_job(dataset_dir, job_dict(), "dp2b.yaml"), workers=1, ranks=2, steps=3)
    topo = Topology(dp=2, pp=2)
    staged = run_job(write_job(dataset_dir, job_dict(topology={"dp": 2, "pp": 2}), "dp2pp2.yaml"), workers=1,
                     ranks=4, steps=3)
    for rank in range(4):
        c = topo.coords(rank)
        want = _by_step(plain[c.dp])
        got = _by_step(staged[rank])
        assert got.keys() == want.keys()
        for key, b in got.items():
            first = ("tokens", "position_ids")
            last = ("labels", "loss_mask")
            for name in first + last:
                if name in (first if c.pp == 0 else last):
                    np.testing.assert_array_equal(b[name], want[key][name])
                else:
                    assert name not in b
            np.testing.assert_array_equal(b["cu_seqlens"], want[key]["cu_seqlens"])
            np.testing.assert_array_equal(b["doc_keys"], want[key]["doc_keys"])


def test_a_middle_stage_gets_the_metadata_only_when_it_asks(dataset_dir):
    from msd.testing.local import LocalJob
    from trainer_client import DataClient, RejectedError

    path = write_job(dataset_dir, job_dict(topology={"dp": 1, "pp": 3}, batch={"seq_len": 512, "micro_batch_size": 1,
                                                                                "global_batch_size": 2}), "pp3.yaml")
    with LocalJob(path, workers=1) as job:
        with DataClient(job.address, rank=1, as_torch=False, timeout_s=20) as plain_middle:
            with pytest.raises(RejectedError, match="metadata_only"):
                next(plain_middle)
        clients = [DataClient(job.address, rank=r, as_torch=False, timeout_s=30, metadata_only=(r == 1))
                   for r in range(3)]
        try:
            for c in clients:
                c.start()  # all stages must be registered before anything is planned
            got = [[next(c) for c in clients] for _ in range(4)]
        finally:
            for c in clients:
                c.close()
    for first, middle, last in got:
        assert "tokens" in first and "labels" not in first
        assert "labels" in last and "tokens" not in last
        assert not {"tokens", "labels", "position_ids", "loss_mask"} & middle.keys()
        np.testing.assert_array_equal(middle["cu_seqlens"], first["cu_seqlens"])
        np.testing.assert_array_equal(middle["doc_keys"], last["doc_keys"])
        assert middle["step"] == first["step"] and middle["micro_batch"] == first["micro_batch"]
