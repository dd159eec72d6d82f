"""How far ahead of the plan sources keep records prepared (coordinator/lead.py)."""

import numpy as np

from coordinator.lead import PrepareLead


def _paced(lead: PrepareLead, steps: int, step_s: float, start: float = 0.0) -> float:
    t = start
    for step in range(steps):
        lead.consumed(t, step)
        t += step_s
    return t


def test_one_step_until_a_step_time_is_measured():
    lead = PrepareLead(3, lookahead_steps=4)
    lead.task_done(0, 3.0)
    np.testing.assert_array_equal(lead.steps_ahead(), [1, 1, 1])
    lead.consumed(0.0, 0)  # one point is no interval yet
    for step in range(1, 5):  # the first look-ahead's steps come in a burst (they were delivered ahead)...
        lead.consumed(0.01 * step, step)
    for step in range(5, 9):
        lead.consumed(step - 4.0, step)
    np.testing.assert_array_equal(lead.steps_ahead(), [1, 1, 1])
    lead.consumed(5.0, 9)  # ...so the pace counts from 2 x 4 + 1 intervals on: their median
    assert 0.95 < lead.step_s <= 1.0  # not the burst's 10 ms
    np.testing.assert_allclose(lead.steps_ahead(), [1 + 3 / lead.step_s, 1, 1])


def test_one_step_and_the_round_trip_in_steps_capped_by_the_look_ahead():
    lead = PrepareLead(3, lookahead_steps=4)
    _paced(lead, 12, step_s=0.4)
    assert abs(lead.step_s - 0.4) < 1e-9
    lead.task_done(0, 0.02)  # a hundredth of a step
    lead.task_done(1, 1.0)  # 2.5 steps
    lead.task_done(2, 30.0)  # longer than the look-ahead
    np.testing.assert_allclose(lead.steps_ahead(), [1.05, 3.5, 5])


def test_a_slow_task_widens_its_source_at_once_and_narrows_it_over_tasks():
    lead = PrepareLead(1, lookahead_steps=4)
    _paced(lead, 12, step_s=1.0)
    lead.task_done(0, 0.1)
    assert lead.steps_ahead()[0] == 1.1
    version = lead.version
    lead.task_done(0, 2.5)
    assert lead.steps_ahead()[0] == 3.5 and lead.version > version
    narrowed = 0
    while lead.steps_ahead()[0] > 1.5:
        lead.task_done(0, 0.1)
        narrowed += 1
    assert 2 <= narrowed <= 5


def test_the_pace_follows_the_slowest_rank_and_is_measured_again_after_a_rewind():
    lead = PrepareLead(1, lookahead_steps=4)
    _paced(lead, 10, step_s=1.0)  # step 9 at 9 s
    lead.consumed(9.5, 9)  # no advance: no interval
    assert abs(lead.step_s - 1.0) < 1e-9
    lead.consumed(12.0, 12)  # three steps in 3 s
    assert abs(lead.step_s - 1.0) < 1e-9
    lead.consumed(12.01, 13)  # a burst of buffered steps, or a pause for a checkpoint, moves it little
    lead.consumed(12.02, 14)
    lead.consumed(30.0, 15)
    assert abs(lead.step_s - 1.0) < 1e-9
    lead.forget_pace()
    lead.consumed(100.0, 2)  # after a rewind the steps start lower: a new reference, not an interval
    assert abs(lead.step_s - 1.0) < 1e-9
    for step in range(3, 12):  # a new pace
        lead.consumed(100.0 + 0.1 * (step - 2), step)
    assert abs(lead.step_s - 0.1) < 1e-9
