"""balance.calibrate with real processes: ranks spend on each micro-batch the time a hidden model
gives; the coordinator fits it, adopts it from a step not yet planned, journals it, shows it, and
`msd manifest` replays exactly the stream that was served; `msd plan --cost-from` plans with it."""

import os
import time

import orjson
import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.journal import read_cost_journal
from coordinator.testing.local import LocalJob
from tests.conftest import job_dict, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

TRUTH = (1.0, 40000.0)  # linear-dominated, against a purely quadratic job model


def _rank(address, rank, steps, out):
    from trainer_client import DataClient

    a, b = TRUTH
    client = DataClient(address, rank=rank, as_torch=False, timeout_s=90)
    got = []
    for batch in client:
        n = batch["piece_lengths"].astype(float)
        time.sleep(2e-9 * float((a * n * n + b * n).sum()))  # ~1-10 ms a micro-batch
        got.append((batch["step"], batch["micro_batch"], batch["doc_keys"].tolist(), batch["doc_offsets"].tolist(),
                    batch["piece_lengths"].tolist()))
        if batch["micro_batch"] == client.micro_batches_per_step - 1 and batch["step"] + 1 >= steps:
            break
    client.close()
    out.put((rank, got))


def test_calibration_is_adopted_journaled_and_replayed(dataset_dir, tmp_path):
    import multiprocessing as mp

    job = job_dict(balance={"cost": {"quadratic": 1.0, "linear": 0.0}, "token_slack": 0.25, "calibrate": True})
    path = write_job(dataset_dir, job, "calibrate.yaml")
    state = str(tmp_path / "state")
    ctx = mp.get_context("spawn")
    steps = 40
    with LocalJob(path, workers=2, state_dir=state) as cluster:
        out = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(cluster.address, r, steps, out)) for r in range(2)]
        for p in procs:
            p.start()
        received = dict(out.get(timeout=240) for _ in procs)
        r = CliRunner().invoke(main, ["status", "--coordinator", cluster.address, "--json"])
        for p in procs:
            p.join(30)
    changes = read_cost_journal(state)
    assert changes, r.output[-3000:]
    at, (q, lin, _, _, _) = changes[0]
    assert 0 < at < steps and lin > 0 and abs((q / lin) / (TRUTH[0] / TRUTH[1]) - 1) < 0.5
    assert r.exit_code == 0, r.output
    status = orjson.loads(r.output)
    assert status["cost_model"]["calibrate"] and status["cost_model"]["changes"]
    # the stream served, before and after the change, is the one the journal replays
    for step in (at - 1, at, steps - 1):
        m = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", str(step), "--json"])
        assert m.exit_code == 0, m.output
        manifest = orjson.loads(m.output)
        for rank, pieces in manifest["ranks"].items():
            for mb in (0, 1):
                want = [(p["doc_key"], p["offset"], p["length"]) for p in pieces if p["micro_batch"] == mb]
                got = next(list(zip(k, o, n)) for s, b, k, o, n in received[int(rank)] if s == step and b == mb)
                assert want == got, (step, rank, mb)
    report = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["report", "--state-dir", state, "--out", str(report), "--max-steps", "10"])
    assert r.exit_code == 0, r.output
    html = report.read_text()
    assert 'id="cost-fit"' in html and "data:image/png" in html.split('id="cost-fit"')[1][:200]
    plan = CliRunner().invoke(main, ["plan", path, "--steps", "5", "--json", "--cost-from", state])
    assert plan.exit_code == 0, plan.output
    assert orjson.loads(plan.output)["cost"]["linear"] == changes[-1][1][1]
