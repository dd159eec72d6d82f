"""A coordinator that fails writes its stimulus log, and the log replays the run, failure included,
in a unit test's way: a fresh CoordinatorState fed the same bursts returns the same instructions.
The coordinator runs in this process (its shell in a thread, a real ROUTER socket), with a real
worker host process and a real DataClient."""

import glob
import os

import pytest

from coordinator import stimulus
from coordinator.app import Coordinator
from msd_common.spec import load_job
from coordinator.instructions import Send, Stop
from coordinator.sources import open_sources
from coordinator.state import CoordinatorState
from msd.testing.local import _SPAWN, _host_main, serve_in_thread
from tests.conftest import job_dict, write_job
from trainer_client import DataClient, JobFailedError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]
FAIL_AT_STEP = 4


def test_a_failed_coordinator_leaves_a_log_that_replays_its_failure(dataset_dir, tmp_path, monkeypatch):
    path = write_job(dataset_dir, job_dict(topology={"dp": 1}), "stimulus.yaml")
    job = load_job(path)
    dispatch = CoordinatorState._dispatch

    def failing(self, plan):
        if plan.step == FAIL_AT_STEP:
            raise RuntimeError(f"injected failure at step {plan.step}")
        return dispatch(self, plan)

    monkeypatch.setattr(CoordinatorState, "_dispatch", failing)
    state_dir = str(tmp_path / "state")
    coord = Coordinator(job, open_sources(job), "tcp://127.0.0.1:*", state_dir=state_dir)
    loop, thread, address = serve_in_thread(coord)
    host = _SPAWN.Process(target=_host_main, args=(address, 1, "WARNING", None))
    host.start()
    steps = set()
    try:
        with DataClient(address, rank=0, as_torch=False, timeout_s=30) as client:
            # the failure reaches the rank, with its reason (issue 48: it ended the stream as if done)
            with pytest.raises(JobFailedError, match=f"injected failure at step {FAIL_AT_STEP}"):
                for batch in client:
                    steps.add(batch["step"])
        thread.join(20)
    finally:
        host.terminate()
        host.join(10)
        loop.call_soon_threadsafe(coord.terminate)
        thread.join(10)
    # the steps before the failure were served (the last one may be cut short by the shutdown)
    assert coord.failed and set(range(FAIL_AT_STEP - 1)) <= steps <= set(range(FAIL_AT_STEP))
    [dump_path] = glob.glob(os.path.join(state_dir, "stimulus-*.msgpack"))
    dump = stimulus.load(dump_path)
    assert dump.complete
    stops = [i for _, out in dump.entries for i in out if isinstance(i, Stop)]
    assert len(stops) == 1 and stops[0].failed and f"step {FAIL_AT_STEP}" in stops[0].reason
    sent_steps = {i.message.step for _, out in dump.entries for i in out
                  if isinstance(i, Send) and i.message.TYPE in ("step_header", "deliver")}
    assert sent_steps == set(range(FAIL_AT_STEP))  # nothing of the failed step went out
    result = stimulus.replay(dump, stimulus.build_state(dump))
    assert result.mismatch is None, (result.mismatch, result.expected, result.got)
    assert result.bursts == len(dump.entries)
