"""The step history (what the state keeps and decides to journal) and the journal file (what the
shell writes): durable planner states per step, reload, compaction, bad files."""

import pytest

from coordinator import history as H
from coordinator import journal as J
from coordinator.history import StepHistory
from coordinator.journal import JournalFile
from coordinator.plan import PlannerState


def _state(step):
    return PlannerState(step, [step * 3, step], [None, (step, 7, 100, 900)], [step * 1.5, step / 3], [step, 2 * step],
                        [False, step > 5])


def _write(path, steps, digest="d1"):
    f = JournalFile(str(path), digest)
    f.append(_state(k).to_json() for k in steps)
    f.close()
    return f


def test_states_survive_a_restart_exactly(tmp_path):
    _write(tmp_path, range(10))
    again = StepHistory(True, JournalFile(str(tmp_path), "d1").load())
    assert again.latest == _state(9)
    assert again.state_before(4) == _state(4) and again.oldest == 0


def test_a_torn_last_line_is_ignored(tmp_path):
    _write(tmp_path, [0])
    with open(tmp_path / J.JOURNAL, "ab") as f:
        f.write(b'{"digest": "d1", "state": {"next_st')  # a write cut by a crash
    assert StepHistory(True, JournalFile(str(tmp_path), "d1").load()).latest == _state(0)


def test_a_changed_job_or_a_corrupt_entry_is_refused(tmp_path):
    _write(tmp_path, [0, 1])
    with pytest.raises(ValueError, match="plan digest"):
        JournalFile(str(tmp_path), "other").load()
    assert len(JournalFile(str(tmp_path), "other").load(accept_changed_job=True)) == 2
    lines = (tmp_path / J.JOURNAL).read_bytes().splitlines()
    (tmp_path / J.JOURNAL).write_bytes(b"garbage\n" + lines[1] + b"\n")
    with pytest.raises(ValueError, match=":1: corrupt journal entry"):
        JournalFile(str(tmp_path), "d1").load()


def test_compaction_keeps_the_latest_state_only(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "COMPACT_AFTER", 5)
    history, f = StepHistory(True), JournalFile(str(tmp_path), "d1")
    for k in range(8):
        j, compact = history.record(_state(k))
        f.compact(j) if compact else f.append([j])
    assert history.oldest == 5 and history.latest == _state(7)
    f.close()
    again = StepHistory(True, JournalFile(str(tmp_path), "d1").load())
    assert again.latest == _state(7) and again.oldest == history.oldest
    assert again.state_before(0) is None


def test_without_a_journal_the_history_is_in_memory_only():
    h = StepHistory(False)
    assert h.record(_state(0)) == (_state(0).to_json(), False)
    assert h.state_before(0) == _state(0) and not h.on_disk(0)


def test_memory_keeps_recent_steps_and_older_ones_come_from_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(H, "MEMORY_STEPS", 4)
    history, f = StepHistory(True), JournalFile(str(tmp_path), "d1")
    f.append(history.record(_state(k))[0] for k in range(20))
    assert len(history.states) <= 8 and not history.in_memory(2) and history.on_disk(2)
    assert history.state_before(2) is None  # not in memory: the shell reads it back and passes it in
    assert history.state_before(2, f.read_state(2)) == _state(2) and history.oldest == 0
    memory_only = StepHistory(False)
    for k in range(20):
        memory_only.record(_state(k))
    assert memory_only.state_before(2) is None and memory_only.oldest >= 12
