"""runtime.ahead_bytes: the coordinator plans no step past the slowest rank's next one while the
steps ahead hold that many bytes of images (a processor's arrays) for some rank, as the workers
reported them when preparing; the stream stays the one planned without a budget, and a step larger
than the whole budget still goes (nothing waits on the budget alone)."""

from __future__ import annotations

import pytest

from msd_common.spec import ConfigError, parse_job
from tests.conftest import job_dict

from .coordinator_driver import Driver

MB = 1 << 20
STEPS = 10


def _job(dataset_dir, ahead_bytes=None):
    runtime = {"lookahead_steps": 4} | ({"ahead_bytes": ahead_bytes} if ahead_bytes is not None else {})
    return parse_job(job_dict(runtime=runtime), "job.yaml", base_dir=dataset_dir)


def _driver(job, image_mb: int) -> Driver:
    d = Driver(job)
    d.array_bytes = lambda source, record: image_mb * MB if source == 0 else 0  # source 0's records carry images
    d.add_worker("w0")
    d.add_rank(0)
    d.add_rank(1)
    return d


def _ahead_while_ranks_wait(job, image_mb: int) -> tuple[int, int]:
    """(steps planned, the most bytes a rank has coming) with ranks that train on nothing."""
    d = _driver(job, image_mb)
    d.hold_consumed = True
    for _ in range(300):
        d.flush() if d.pending else d.tick()
    return d.state.planned_until, d.state.ahead.held()


def test_steps_ahead_stop_at_the_budget_and_the_stream_is_unchanged(dataset_dir):
    free = _job(dataset_dir)
    assert free.runtime.ahead_bytes == 4 << 30  # the default
    planned, held = _ahead_while_ranks_wait(free, image_mb=8)
    assert planned == 4  # lookahead_steps (steps 0..3 before any is consumed): the budget is far away
    budget = 20 * MB
    capped = _job(dataset_dir, budget)
    planned_capped, held_capped = _ahead_while_ranks_wait(capped, image_mb=8)
    assert 1 <= planned_capped < planned
    assert held_capped >= budget and held_capped < held  # stopped once a rank's steps ahead held the budget
    # the same stream, with and without the budget, ranks training
    runs = []
    for job in (free, capped):
        d = _driver(job, image_mb=8)
        d.run(STEPS)
        assert not d.unserved
        runs.append(d.stream(STEPS))
    assert runs[0] == runs[1]


def test_a_step_larger_than_the_budget_still_goes(dataset_dir):
    job = _job(dataset_dir, ahead_bytes=1)  # every record alone is over it
    planned, _ = _ahead_while_ranks_wait(job, image_mb=64)
    assert planned == 1  # the step ranks need, and no more
    d = _driver(job, image_mb=64)
    d.run(STEPS)  # never stalls
    assert min(r.consumed for r in d.ranks.values()) >= STEPS - 1


def test_ahead_bytes_is_checked(dataset_dir):
    with pytest.raises(ConfigError) as e:
        _job(dataset_dir, ahead_bytes=0)
    assert any(p.startswith("runtime.ahead_bytes") for p in e.value.problems), e.value.problems
    with pytest.raises(ConfigError):
        _job(dataset_dir, ahead_bytes="4GB")
    assert _job(dataset_dir, 123).runtime.ahead_bytes == 123
