"""balance.calibrate with real processes: ranks spend on each micro-batch the time a hidden model
gives; the coordinator fits it, adopts it from a step not yet planned, journals it, shows it, and
`msd manifest` replays exactly the stream that was served; `msd plan --cost-from` plans with it."""

import time

import orjson
import pytest
from click.testing import CliRunner

from msd.cli import main
from coordinator.journal import read_cost_journal
from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from tests.integration.harness import manifest, manifest_pieces

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


def _serve(path, state, rank_fn, steps, then=None):
    """The job with two trainer processes, each running rank_fn(address, rank, steps, out) to the
    end: ({rank: what it put}, then(address) called before the job stops)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with LocalJob(path, workers=2, state_dir=state) as cluster:
        out = ctx.Queue()
        procs = [ctx.Process(target=rank_fn, args=(cluster.address, r, steps, out)) for r in range(2)]
        for p in procs:
            p.start()
        received = dict(out.get(timeout=240) for _ in procs)
        after = then(cluster.address) if then else None
        for p in procs:
            p.join(30)
    return received, after


def test_calibration_is_adopted_journaled_and_replayed(dataset_dir, tmp_path):
    job = job_dict(balance={"cost": {"quadratic": 1.0, "linear": 0.0}, "token_slack": 0.25, "calibrate": True})
    path = write_job(dataset_dir, job, "calibrate.yaml")
    state = str(tmp_path / "state")
    steps = 40
    received, r = _serve(path, state, _rank, steps,
                         then=lambda address: CliRunner().invoke(main, ["status", "--coordinator", address, "--json"]))
    changes = read_cost_journal(state)
    assert changes, r.output[-3000:]
    at, (q, lin, _, _, _) = changes[0]
    assert 0 < at < steps and lin > 0 and abs((q / lin) / (TRUTH[0] / TRUTH[1]) - 1) < 0.5
    assert r.exit_code == 0, r.output
    status = orjson.loads(r.output)
    assert status["cost_model"]["calibrate"] and status["cost_model"]["changes"]
    # the stream served, before and after the change, is the one the journal replays
    for step in (at - 1, at, steps - 1):
        got = {(rank, b): list(zip(k, o, n)) for rank, batches in received.items()
               for s, b, k, o, n in batches if s == step}
        assert manifest_pieces(manifest(state, step)) == got, step
    report = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["report", "--state-dir", state, "--out", str(report), "--max-steps", "10"])
    assert r.exit_code == 0, r.output
    html = report.read_text()
    assert 'id="cost-fit"' in html and "data:image/png" in html.split('id="cost-fit"')[1][:200]
    plan = CliRunner().invoke(main, ["plan", path, "--steps", "5", "--json", "--cost-from", state])
    assert plan.exit_code == 0, plan.output
    assert orjson.loads(plan.output)["cost"]["linear"] == changes[-1][1][1]


IMAGE_TOKEN = 300
PATCH_TRUTH = (1.0, 4.0)  # seconds per token and per patch^2 (x a scale): an image encoder's attention


def _image_rank(address, rank, steps, out):
    import numpy as np

    from trainer_client import DataClient

    b, pq = PATCH_TRUTH
    client = DataClient(address, rank=rank, as_torch=False, timeout_s=90)
    for batch in client:
        ends = np.cumsum(batch["piece_lengths"])
        tokens = batch["tokens"].reshape(-1)  # one row a micro-batch
        patches = np.array([np.count_nonzero(tokens[e - n:e] == IMAGE_TOKEN)
                            for e, n in zip(ends, batch["piece_lengths"])], dtype=float)
        time.sleep(4e-6 * float(b * batch["num_tokens"] + pq * (patches ** 2).sum()))  # ~2-8 ms
        if batch["micro_batch"] == client.micro_batches_per_step - 1 and batch["step"] + 1 >= steps:
            break
    client.close()
    out.put((rank, None))


def test_calibration_finds_the_patch_cost_of_image_pieces(tmp_path):
    """An image-text job whose file says nothing of patches: the patches of each micro-batch's pieces
    are features of the fit, so the calibrated model charges images their own cost."""
    from msd.testing.multimodal_data import captions, write_parquet, write_webdataset

    root = tmp_path / "mm"
    (root / "images").mkdir(parents=True)
    write_webdataset(str(root / "images" / "img-000.tar"), 150, seed=1, sizes=(32, 200))
    write_parquet(str(root / "text.parquet"), captions()[:600], row_group_size=50)
    job = {
        "seed": 7,
        "sources": {
            "text": {"format": "parquet", "paths": ["text.parquet"], "text_key": "text"},
            "images": {"format": "webdataset", "paths": ["images/*.tar"], "image_token_id": IMAGE_TOKEN,
                       "max_pixels": 192 * 192, "patch_size": 16},
        },
        "batch": {"seq_len": 512, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"text": 0.5, "images": 0.5}},
        "balance": {"cost": {"quadratic": 1.0, "linear": 0.0}, "token_slack": 0.25, "calibrate": True},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 8, "lookahead_steps": 3},
    }
    path = write_job(str(root), job, "mm.yaml")
    state = str(tmp_path / "state")
    steps = 60
    _serve(path, state, _image_rank, steps)
    changes = read_cost_journal(state)
    assert changes
    q, lin, _, pq, _ = changes[-1][1]
    assert pq > 0 and lin > 0, changes
    assert abs((pq / lin) / (PATCH_TRUTH[1] / PATCH_TRUTH[0]) - 1) < 0.5, changes
    assert q * 512 < 0.25 * lin, changes  # the quadratic term the job file guessed is gone
    # the stream after the change is the one `msd manifest` replays with the patch terms
    m = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", str(steps - 1), "--json"])
    assert m.exit_code == 0, m.output
