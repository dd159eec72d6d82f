"""The step journal: durable planner states per step, reload, compaction, bad files."""

import pytest

from coordinator import journal as J
from coordinator.journal import StepJournal
from coordinator.plan import PlannerState


def _state(step):
    return PlannerState(step, [step * 3, step], [None, (step, 7, 100, 900)], [step * 1.5, step / 3], [step, 2 * step],
                        [False, step > 5])


def test_states_survive_a_restart_exactly(tmp_path):
    j = StepJournal(str(tmp_path), "d1")
    for k in range(10):
        j.record(_state(k))
    j.flush()
    j.close()
    again = StepJournal(str(tmp_path), "d1")
    assert again.latest == _state(9)
    assert again.state_before(4) == _state(4) and again.oldest == 0


def test_an_unflushed_tail_is_lost_and_a_torn_last_line_ignored(tmp_path):
    j = StepJournal(str(tmp_path), "d1")
    j.record(_state(0))
    j.flush()
    j.record(_state(1))  # never flushed: as if the coordinator died before dispatching step 1
    with open(tmp_path / J.JOURNAL, "ab") as f:
        f.write(b'{"digest": "d1", "state": {"next_st')  # a write cut by a crash
    again = StepJournal(str(tmp_path), "d1")
    assert again.latest == _state(0)


def test_a_changed_job_or_a_corrupt_entry_is_refused(tmp_path):
    j = StepJournal(str(tmp_path), "d1")
    j.record(_state(0))
    j.record(_state(1))
    j.close()
    with pytest.raises(ValueError, match="plan digest"):
        StepJournal(str(tmp_path), "other")
    lines = (tmp_path / J.JOURNAL).read_bytes().splitlines()
    (tmp_path / J.JOURNAL).write_bytes(b"garbage\n" + lines[1] + b"\n")
    with pytest.raises(ValueError, match=":1: corrupt journal entry"):
        StepJournal(str(tmp_path), "d1")


def test_compaction_keeps_the_latest_state_only(tmp_path, monkeypatch):
    monkeypatch.setattr(J, "COMPACT_AFTER", 5)
    j = StepJournal(str(tmp_path), "d1")
    for k in range(8):
        j.record(_state(k))
        j.flush()
    assert j.oldest > 0 and j.latest == _state(7)
    j.close()
    again = StepJournal(str(tmp_path), "d1")
    assert again.latest == _state(7) and again.oldest == j.oldest
    assert again.state_before(0) is None


def test_without_a_state_dir_the_history_is_in_memory_only(tmp_path):
    j = StepJournal(None, "d1")
    j.record(_state(0))
    j.flush()
    assert j.state_before(0) == _state(0)


def test_memory_keeps_recent_steps_and_older_ones_come_from_disk(tmp_path, monkeypatch):
    monkeypatch.setattr(J, "MEMORY_STEPS", 4)
    j = StepJournal(str(tmp_path), "d1")
    for k in range(20):
        j.record(_state(k))
    j.flush()
    assert len(j.history) <= 8 and 0 not in j.history
    assert j.state_before(2) == _state(2) and j.oldest == 0  # read back from the file
    memory_only = StepJournal(None, "d1")
    for k in range(20):
        memory_only.record(_state(k))
    assert memory_only.state_before(2) is None and memory_only.oldest >= 12
