"""The coordinator's bookkeeping, transition by transition: the task book (queued -> in flight ->
done, attempts) and the delivery book (sent -> acknowledged -> done, orphaned -> re-sent)."""

import numpy as np
import pytest

from coordinator.deliveries import DeliveryBook, DeliveryState
from coordinator.tasks import TaskBook


def _positions(*p):
    return np.array(p, dtype=np.int64)


def test_a_task_is_queued_then_in_flight_then_done_by_its_worker_only():
    book = TaskBook()
    t = book.new(2, _positions(5, 6, 7))
    assert book.queued() == [t] and book.queued() == []  # taken out of the queue once
    book.assign(t, worker_id=1, estimate_s=0.5)
    assert (t.worker_id, t.attempts, book.backlog_s(1), book.in_flight(1)) == (1, 1, 0.5, 1)
    assert book.complete(t.task_id, worker_id=2) is None  # not that worker's: ignored, still in flight
    assert book.complete(t.task_id, worker_id=1) is t
    assert len(book) == 0 and book.backlog_s(1) == 0.0 and book.in_flight(1) == 0
    assert book.complete(t.task_id, worker_id=1) is None  # a repeated result


def test_a_dead_workers_tasks_go_back_to_the_queue_in_order_and_count_their_attempts():
    book = TaskBook()
    a, b, c = book.new(0, _positions(1)), book.new(0, _positions(2)), book.new(1, _positions(3))
    book.queued()
    book.assign(b, 4, 1.0)
    book.assign(a, 4, 1.0)
    book.assign(c, 5, 1.0)
    assert book.withdraw(4) == [a, b] and book.backlog_s(4) == 0.0
    assert book.queued() == [a, b] and a.worker_id is None
    book.assign(a, 5, 1.0)
    assert a.attempts == 2 and book.backlog_s(5) == 2.0
    assert book.complete(a.task_id, 4) is None  # a late result from the dead worker is not taken


def test_a_failed_task_is_queued_again_avoiding_that_worker():
    book = TaskBook()
    t = book.new(0, _positions(9))
    book.queued()
    book.assign(t, 3, 0.1)
    assert book.fail(t.task_id, 3) is t and t.avoid == 3 and book.queued() == [t]
    assert book.fail(t.task_id, 3) is None  # not in flight any more


def test_task_floors_and_clear():
    book = TaskBook()
    book.new(0, _positions(8, 4))
    book.new(2, _positions(11))
    assert book.floors(3) == [4, None, 11]
    book.clear()
    assert len(book) == 0 and book.queued() == [] and book.floors(3) == [None] * 3


def _delivery(book, worker, step, ranks=(0,), positions=((0, 1),), release=((0, 1),)):
    items = np.array([[r, 0, 1, 0, 5] for r in ranks], dtype=np.uint64)
    return book.open(worker, step, items, np.array(positions), np.array(release), list(ranks))


def test_a_delivery_is_sent_then_acknowledged_then_done_when_its_ranks_consumed_the_step():
    book = DeliveryBook()
    d = _delivery(book, worker=1, step=3, ranks=(0, 1))
    assert d.state is DeliveryState.SENT and book.holds(1)
    assert book.acknowledge(d.delivery_id, worker_id=2) is None  # another worker's ack: ignored
    assert book.acknowledge(d.delivery_id, worker_id=1) is d and d.state is DeliveryState.ACKED
    assert book.acknowledge(d.delivery_id, worker_id=1) is None  # repeated
    consumed = {0: 3, 1: 2}
    assert book.finish_consumed(lambda r: consumed.get(r, -1)) == 0  # rank 1 has not consumed step 3
    consumed[1] = 3
    assert book.finish_consumed(lambda r: consumed.get(r, -1)) == 1
    assert len(book) == 0 and not book.holds(1)


def test_a_dead_workers_deliveries_are_orphaned_and_come_back_in_step_order():
    book = DeliveryBook()
    late = _delivery(book, 1, step=7)
    early = _delivery(book, 1, step=2)
    acked = _delivery(book, 1, step=5)
    other = _delivery(book, 2, step=1)
    book.acknowledge(acked.delivery_id, 1)
    sent, was_acked = book.orphan(1)
    assert sent == [late, early] and was_acked == [acked] and book.orphaned == 3
    assert [d.step for d in book.orphans()] == [2, 5, 7] and not book.holds(1)
    assert other.state is DeliveryState.SENT and book.holds(2)
    book.replaced(early)
    assert [d.step for d in book.orphans()] == [5, 7] and book.orphaned == 2
    with pytest.raises(AssertionError):
        book.replaced(other)  # only an orphan is re-sent
    assert book.counts() == {"sent": 1, "acknowledged": 0, "orphaned": 2}


def test_delivery_needs_floors_and_clear():
    book = DeliveryBook()
    d = _delivery(book, 1, 0, positions=((0, 9), (2, 4)), release=((0, 3),))
    assert d.needs() == {(0, 9), (2, 4), (0, 3)}
    assert book.floors(3) == [3, None, 4]
    book.orphan(1)
    book.clear()
    assert len(book) == 0 and book.orphaned == 0 and book.orphans() == []


def test_a_task_that_killed_its_worker_is_split_into_one_task_per_record_keeping_its_history():
    book = TaskBook()
    task = book.new(2, np.array([10, 11, 12]))
    book.assign(book.queued()[0], worker_id=4, estimate_s=1.0)
    assert book.get(task.task_id) is task and task.workers == [4]
    book.withdraw(4)
    task.deaths += 1
    singles = book.split(task)
    assert book.get(task.task_id) is None
    assert [t.positions.tolist() for t in singles] == [[10], [11], [12]]
    assert all(t.deaths == 1 and t.workers == [4] and t.source == 2 for t in singles)
    assert book.queued() == singles and len(book) == 3
    book.drop(singles[0])
    assert len(book) == 2


def test_the_registry_knows_the_slowest_rank_without_asking_every_rank_each_time():
    """slowest() (cached, kept by Registry.consumed) always equals min(consumed) over the ranks,
    through ranks consuming (one rank's message, or a relay's rows of several at once, capped at the
    plan's last step), coming, going and rewinding (a rank registered again further back)."""
    import random

    from coordinator.registry import Registry, TrainerInfo

    reg, rng = Registry(), random.Random(3)
    for r in range(8):
        reg.add_trainer(TrainerInfo(r, bytes([r]), f"tcp://x:{r}", 0.0, -1))
    for _ in range(2000):
        op = rng.random()
        ranks = list(reg.trainers)
        if op < 0.85 and ranks:
            chosen = [reg.trainers[r] for r in rng.sample(ranks, rng.randint(1, len(ranks)))]
            rows = [(t, t.consumed + rng.randint(0, 2) if rng.random() < 0.98 else rng.randint(-1, 5), rng.random())
                    for t in chosen]
            before = {t.rank: t.consumed for t in chosen}
            last = rng.randint(0, 40)
            furthest = reg.consumed(rows, last)
            for t, step, _ in rows:  # never back, never past the plan
                assert t.consumed == max(before[t.rank], min(step, last))
            assert furthest == max(t.consumed for t in chosen)
        elif op < 0.93 and len(ranks) > 1:
            reg.remove(reg.trainers[rng.choice(ranks)].identity)
        else:
            r = rng.randint(0, 15)
            reg.add_trainer(TrainerInfo(r, bytes([r, 1]), f"tcp://x:{r}", 0.0, rng.randint(-1, 30)))
        assert reg.slowest() == min(t.consumed for t in reg.trainers.values())
        assert reg.all_present({0, 1}) == ({0, 1} <= reg.trainers.keys())
