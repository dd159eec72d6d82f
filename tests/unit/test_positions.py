"""The coordinator's per-source table of stream positions."""

import numpy as np
import pytest

from coordinator.positions import NOBODY, UNKNOWN, PositionTable


def test_issue_prepare_window_release_and_forget():
    t = PositionTable()
    pos = t.issue(np.arange(100, 2100))  # grows past its first allocation
    assert pos[0] == 0 and pos[-1] == 1999 and t.end == 2000
    records, lengths = t.window(1995, 10)
    assert records.tolist() == [2095, 2096, 2097, 2098, 2099] + [UNKNOWN] * 5
    assert (lengths == UNKNOWN).all()
    before = t.set_prepared(np.arange(0, 1000), np.where(np.arange(1000) % 7 == 0, 0, 5), worker=3)
    assert (before == UNKNOWN).all()
    assert t.holders(np.array([0, 1])).tolist() == [NOBODY, 3]  # a skipped record (length 0) has no holder
    assert t.window(0, 3)[1].tolist() == [0, 5, 5]
    t.release(np.array([1]))
    assert t.holders(np.array([1])).tolist() == [NOBODY]
    held = t.held_by(3)
    assert 2 in held and 1 not in held and len(held) == 1000 - 143 - 1
    assert (t.holders(held) == NOBODY).all()
    t.forget_before(1500)
    assert t.base == 1500 and t.records(np.array([1500])).tolist() == [1600]
    assert t.window(1490, 12)[0].tolist() == [UNKNOWN] * 10 + [1600, 1601]
    with pytest.raises(KeyError):
        t.records(np.array([10]))


def test_shared_held_counts_follow_every_change_of_holders():
    """HeldCounts (kept as holders change) always equals the tables' holders counted afresh."""
    from coordinator.positions import HeldCounts

    rng = np.random.default_rng(5)
    held = HeldCounts()
    tables = [PositionTable(held) for _ in range(3)]
    for _ in range(400):
        t = tables[int(rng.integers(0, 3))]
        op = rng.integers(0, 6)
        live = np.arange(t.base, t.end)
        if op == 0 or not len(live):
            t.issue(rng.integers(0, 1000, int(rng.integers(1, 50))))
        elif op == 1:
            pos = rng.choice(live, min(len(live), 20), replace=False)
            t.set_prepared(pos, rng.integers(0, 5, len(pos)), int(rng.integers(0, 100)))  # 0: skipped, no holder
        elif op == 2:
            t.release(rng.choice(live, min(len(live), 10), replace=False))
        elif op == 3:
            t.held_by(int(rng.integers(0, 100)))
        elif op == 4:
            t.forget_before(int(rng.integers(t.base, t.end + 1)))
        else:
            if rng.random() < 0.1:
                t.reset(t.end)
        want = sum(tab.held_counts(100) for tab in tables)
        np.testing.assert_array_equal(held.counts(100), want)
    assert held.counts(100).sum() > 0
