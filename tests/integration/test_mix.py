"""`msd mix` against a real coordinator (its asyncio loop in a thread, a real ROUTER socket)."""

import os

import pytest
from click.testing import CliRunner

from coordinator.app import Coordinator
from coordinator.journal import read_mixture_journal
from msd.cli import main
from msd_common.spec import parse_job
from coordinator.mix import parse_weights, request_mix
from coordinator.sources import OpenedSources
from msd.testing.local import serve_in_thread
from tests.conftest import job_dict

pytestmark = pytest.mark.timeout(60)


def test_mix_is_checked_journaled_and_replayed(dataset_dir, tmp_path):
    job = parse_job(job_dict(), "job.yaml", base_dir=dataset_dir)
    state = str(tmp_path / "state")
    coord = Coordinator(job, OpenedSources([50, 70, 30]), "tcp://127.0.0.1:*", state_dir=state)
    loop, thread, address = serve_in_thread(coord)
    try:
        ok, reason = request_mix(address, 40, {"web": 1, "code": 1})
        assert ok, reason
        ok, reason = request_mix(address, 50, {"books": 1})
        assert not ok and "books: unknown source" in reason
        ok, reason = request_mix(address, 50, {"web": -1})
        assert not ok and "web: weight must be a finite number >= 0" in reason
        # a primary that is gone, then the standby that serves: the one that answers decides
        gone = "tcp://127.0.0.1:1"
        r = CliRunner().invoke(main, ["mix", "--coordinator", f"{gone},{address}", "--at-step", "60", "long=1",
                                      "--timeout-s", "4"])
        assert r.exit_code == 0, r.output
        r = CliRunner().invoke(main, ["mix", "--coordinator", address, "--at-step", "70", "long"])
        assert r.exit_code == 2 and "expected SOURCE=WEIGHT" in r.output
        coord.state.planner.state.next_step = 80  # as if 80 steps were planned
        ok, reason = request_mix(address, 75, {"web": 1})
        assert not ok and "already planned" in reason
    finally:
        loop.call_soon_threadsafe(coord.terminate)
        thread.join(10)
    assert read_mixture_journal(state) == [(40, [1.0, 1.0, 0.0]), (60, [0.0, 0.0, 1.0])]  # as given
    # a restarted coordinator plans with the same changes
    again = Coordinator(job, OpenedSources([50, 70, 30]), "tcp://127.0.0.1:*", state_dir=state)
    assert again.state.planner.weights_at(39) == pytest.approx(job.weights_at(39))
    assert again.state.planner.weights_at(45) == [0.5, 0.5, 0.0]
    assert again.state.planner.weights_at(61) == [0.0, 0.0, 1.0]
    assert os.path.exists(os.path.join(state, "mixture.journal"))


def test_weights_arguments_are_parsed_strictly():
    assert parse_weights(("web=0.5", "code=2")) == {"web": 0.5, "code": 2.0}
    with pytest.raises(ValueError, match="not a number"):
        parse_weights(("web=lots",))
