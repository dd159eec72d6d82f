"""`msd status` against a real running job: one JSON snapshot, and the live view's rendering."""

import orjson
import pytest
from click.testing import CliRunner
from rich.console import Console

from msd.cli import main
from coordinator.status_view import render
from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job

from .harness import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def test_status_shows_the_running_job(dataset_dir, tmp_path):
    path = write_job(dataset_dir, job_dict(), "status.yaml")
    state = str(tmp_path / "state")
    snapshots = []

    def during(cluster, batches):
        if batches in (40, 120):  # 2 ranks x 2 micro-batches per step: steps 10 and 30
            r = CliRunner().invoke(main, ["status", "--state-dir", state, "--json"])
            assert r.exit_code == 0, r.output
            snapshots.append(orjson.loads(r.output))

    with LocalJob(path, workers=2, state_dir=state) as cluster:
        run_ranks(cluster, ranks=2, steps=40, during=during, compute_s=0.01)
        r = CliRunner().invoke(main, ["status", "--coordinator", cluster.address, "--json"])
        assert r.exit_code == 0, r.output
        snapshots.append(orjson.loads(r.output))
        # not a terminal (a file, a pipe, a script): one view, and it exits (it wrote nothing and never
        # exited before: the live view)
        r = CliRunner().invoke(main, ["status", "--coordinator", cluster.address])
        assert r.exit_code == 0 and "no rank connected" in r.output, r.output  # (the ranks are done)
    first, mid, last = snapshots  # at steps ~10 and ~30, and after the ranks left
    assert first["job"] == path and first["dp"] == 2 and len(first["digest"]) == 16
    assert set(mid["data_wait_s"]) == {"0", "1"} and set(mid["consumed"]) == {"0", "1"}
    assert 25 <= min(mid["consumed"].values()) < 30 and mid["next_step"] >= 30
    assert last["consumed"] == {} and last["next_step"] >= 40
    # the ranks left, and their waits stay (the run's, for msd report and the metrics)
    assert set(last["data_wait_s"]) == {"0", "1"}
    assert all(last["data_wait_s"][r] >= mid["data_wait_s"][r] for r in ("0", "1"))
    assert last["target_share"] == pytest.approx({"web": 0.5, "code": 0.3, "long": 0.2})
    for name, share in last["target_share"].items():  # 40 steps of 8 x 512 tokens: within a piece or so
        assert abs(last["realised_share"][name] - share) < 0.02, name
        assert abs(last["realised_share"][name] - last["target_so_far_share"][name]) < 0.02, name
    [workers] = last["workers_by_host"].values()
    assert len(workers) == 2 and all(0.0 <= w["busy_share"] <= 1.0 for w in workers)
    assert any(w["busy_share"] > 0 for w in workers)
    assert last["journaled_step"] >= 39 and last["journal_lag_steps"] == 0
    assert last["skipped_by_kind"]["web"].get("corrupt", 0) <= 2
    assert isinstance(last["warnings"], list)

    console = Console(record=True, width=140)
    console.print(render(mid))
    text = console.export_text()
    for expected in ("status.yaml", "slowest rank at step", "data wait s", "target so far", "realised so far", "web",
                     "busy share",
                     "last warnings:"):
        assert expected in text, expected


def test_status_says_when_nobody_answers(tmp_path):
    r = CliRunner().invoke(main, ["status", "--coordinator", "tcp://127.0.0.1:1", "--json", "--timeout-s", "1"])
    assert r.exit_code == 1 and "no answer from tcp://127.0.0.1:1" in r.output
    r = CliRunner().invoke(main, ["status", "--json"])
    assert r.exit_code == 2 and "--coordinator" in r.output
