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


class ModelTable:
    """What a position table holds, in plain Python: the reference for the arena's tables."""

    def __init__(self) -> None:
        self.base = self.end = 0
        self.rows: dict[int, list[int]] = {}  # position -> [record, length, holder]

    def issue(self, records):
        out = list(range(self.end, self.end + len(records)))
        for p, r in zip(out, records.tolist()):
            self.rows[p] = [r, UNKNOWN, NOBODY]
        self.end += len(records)
        return out

    def set_prepared(self, positions, lengths, worker):
        before = [self.rows[p][1] for p in positions.tolist()]
        for p, n in zip(positions.tolist(), lengths.tolist()):
            self.rows[p][1:] = [n, worker if n > 0 else NOBODY]
        return before

    def release(self, positions):
        out = [self.rows[p][2] for p in positions.tolist()]
        for p in positions.tolist():
            self.rows[p][2] = NOBODY
        return out

    def held_by(self, worker):
        out = [p for p in range(self.base, self.end) if self.rows[p][2] == worker]
        for p in out:
            self.rows[p][2] = NOBODY
        return out

    def forget_before(self, position):  # the arena's table may keep more: compare from its base
        pass

    def window(self, start, count):
        rows = [self.rows.get(p) if p < self.end else None for p in range(start, start + count)]
        return ([r[0] if r else UNKNOWN for r in rows], [r[1] if r else UNKNOWN for r in rows])


def test_tables_in_one_arena_behave_as_separate_tables():
    """Many sources' tables sharing one arena (moved and packed as they grow) hold what plain
    Python tables hold, and the many-source lookups equal the per-table ones."""
    from coordinator.positions import PositionTables

    rng = np.random.default_rng(11)
    n = 7
    shared = PositionTables([None] * n)
    model = [ModelTable() for _ in range(n)]
    moved = 0
    for _ in range(1500):
        s = int(rng.integers(0, n))
        a, b = shared[s], model[s]
        op = rng.integers(0, 6)
        live = np.arange(a.base, a.end)
        if op <= 1 or not len(live):
            records = rng.integers(0, 10**6, int(rng.integers(1, 1200)))  # tables outgrow their room
            start = a.start
            assert a.issue(records).tolist() == b.issue(records)
            moved += a.start != start
        elif op == 2:
            pos = rng.choice(live, min(len(live), 30), replace=False)
            lengths, worker = rng.integers(0, 5, len(pos)), int(rng.integers(0, 9))
            assert a.set_prepared(pos, lengths, worker).tolist() == b.set_prepared(pos, lengths, worker)
        elif op == 3:
            pos = rng.choice(live, min(len(live), 10), replace=False)
            assert a.release(pos).tolist() == b.release(pos)
        elif op == 4 and rng.random() < 0.3:
            a.forget_before(int(rng.integers(a.base, a.end + 1)))
        elif op == 5:
            worker = int(rng.integers(0, 9))
            b.base = a.base
            assert a.held_by(worker).tolist() == b.held_by(worker)
        assert a.end == b.end
        start, count = int(rng.integers(a.base, a.end + 5)), int(rng.integers(1, 50))
        got, want = a.window(start, count), b.window(start, count)
        assert got[0].tolist() == want[0] and got[1].tolist() == want[1]
    assert moved > 10  # tables did move in the arena
    rows = np.array([[s, p] for s in range(n) for p in range(shared[s].base, shared[s].end, 3)], dtype=np.int64)
    rows = rows[rng.permutation(len(rows))]
    assert shared.records(rows).tolist() == [model[s].rows[p][0] for s, p in rows.tolist()]
    holders = [model[s].rows[p][2] for s, p in rows.tolist()]
    assert shared.holders(rows).tolist() == holders
    assert shared.release(rows).tolist() == holders
    assert (shared.holders(rows) == NOBODY).all()
    with pytest.raises(KeyError):
        shared.records(np.array([[0, shared[0].end]]))
