"""Liveness apart from work, in the coordinator's state machine (issue 57): a worker busy on one long
sample is alive while its host agent vouches for its process; a worker rightly declared dead (a
lost host) while its prepare work is in flight does not leave the job stuck when its stale
messages come in after it registered again; a sample past its source's max_sample_s is poison."""

from coordinator.events import Consumed, WorkerExited
from coordinator.history import StepHistory
from coordinator.instructions import AppendJournal

from .coordinator_driver import Driver
from .test_coordinator_state import STEPS, job, reference  # noqa: F401  (the same job and fault-free stream)


def _started(job, host: bool) -> Driver:
    d = Driver(job)
    d.add_worker("w0")
    d.add_worker("w1")
    if host:
        d.add_host()
    d.add_rank(0)
    d.add_rank(1)
    d.flush()
    return d


def _busy(d: Driver, seconds: float) -> None:
    """Both workers start a sample that takes this long: they read and say nothing meanwhile."""
    for w in d.workers.values():
        w.busy_until = d.now + seconds


def test_a_worker_busy_for_many_heartbeats_is_alive_while_its_agent_vouches_for_it(job, reference):
    d = _started(job, host=True)
    _busy(d, 20 * d.state.heartbeat_s)  # ten times the silence that declares a peer dead
    d.run(STEPS)
    assert d.stream(STEPS) == reference and not d.unserved
    assert sorted(d.state.registry.workers) == [0, 1], "nobody was declared dead or registered again"
    assert d.state.prep.reprepared == 0


def test_workers_declared_dead_with_work_in_flight_register_again_and_the_job_completes(job, reference):
    """No agent vouches (a host lost, then back): both workers are declared dead while busy, and the
    prepare and deliver messages sent to their old registrations wait in their sockets. When they
    are read, after the workers registered again, they are dropped (the Idefics3 stall: they spent
    copies the books no longer counted, so pieces were never sent and no one said so)."""
    d = _started(job, host=False)
    d.run(2)
    _busy(d, 5 * d.state.heartbeat_s)
    d.run(STEPS)
    assert d.stream(STEPS) == reference
    assert not d.unserved, "a stale message spent a prepared copy"
    assert 0 not in d.state.registry.workers or 1 not in d.state.registry.workers, "declared dead"


def test_a_worker_whose_cache_lost_pieces_is_forgotten_and_they_are_prepared_again(job, reference):
    """A worker that cannot send pieces it was asked for says so (delivered.unserved): the
    coordinator prepares what it held elsewhere and sends its deliveries again, so no rank waits
    for good."""
    d = _started(job, host=True)
    lost = []

    def lose_cache(drv, worker, ins):
        if ins.message.step == 4 and not lost:
            worker.cache.clear()
            lost.append(worker.worker_id)
        return None

    d.on_deliver = lose_cache
    d.run(STEPS)
    assert lost and d.unserved, "the worker had nothing to send"
    assert d.stream(STEPS) == reference
    assert lost[0] not in d.state.registry.workers, "the worker was forgotten (it registers again)"


def test_a_sample_past_max_sample_s_quarantines_its_record_at_once(job, reference):
    """The agent stopped a worker whose sample ran past the limit: the record is quarantined at
    the first overrun (retrying it would hold a worker as long again), the task goes elsewhere."""
    d = _started(job, host=True)
    d.run(1)
    w = d.workers[b"w1"]
    task = next(iter(d.state.tasks._by_worker.get(w.worker_id, ())), -1)
    d.kill(b"w1")
    out = d.handle(WorkerExited(at=d.now, peer=b"host", agent_id=1, pid=w.pid, exitcode=-9, task_id=task, source=0,
                                record=123, overran_s=2.5))
    assert 123 in d.state.quarantined[0]
    assert [type(i).__name__ for i in out if type(i).__name__ == "AppendQuarantine"] == []  # not durable here
    assert w.worker_id not in d.state.registry.workers
    d.run(STEPS)
    assert d.state.skipped_by_kind[0].get("quarantined", 0) >= 0


def _taken_over(job, steps: int) -> tuple[Driver, Driver]:
    """A run of `steps` steps with a journal, and a second coordinator (a standby, or a restart)
    that starts from that journal with a worker and no rank yet."""
    first = Driver(job, StepHistory(durable=True))
    first.add_worker("w0")
    first.add_rank(0)
    first.add_rank(1)
    first.run(steps)
    journal = [line for ins in first.out if isinstance(ins, AppendJournal) for line in ins.states]
    standby = Driver(job, StepHistory(durable=True, loaded=journal))
    standby.add_worker("w0")
    return first, standby


def test_ranks_at_different_steps_all_resume_on_a_coordinator_that_took_over(job, reference):
    """A standby (or a restart) restores the plan at step k; the ranks come back one by one at the
    steps they had reached, the one further back first. It rewinds the plan to its step; the one
    further on (still behind where the plan stood) is welcomed too, not refused as ahead of the plan
    (bench_failover found this: SIGTERM hands over so fast that the ranks are still apart)."""
    _, standby = _taken_over(job, 6)
    standby.add_rank(0, resume_step=5)
    standby.flush()
    assert standby.state.planner.state.next_step == 5  # rewound for rank 0
    standby.add_rank(1, resume_step=6)
    out = standby.flush()
    assert not standby.sends(out, "reject"), [i.message for i in standby.sends(out, "reject")]
    standby.run(STEPS)
    got = standby.stream(STEPS)
    assert {k: v for k, v in got.items() if k[1] >= 6} == {k: v for k, v in reference.items() if k[1] >= 6}


def test_ranks_that_assembled_steps_after_their_hello_report_them_and_the_plan_goes_on(job, reference):
    """A rank says hello to the coordinator that took over at the step it had assembled then, and
    goes on assembling the steps the last coordinator delivered (their pieces were on the way). Its
    `consumed` for those steps is further on than the rewound plan: it counts (it was clamped to the
    plan's step, so the look-ahead never reached the rank's next step: the SIGTERM handover test
    stalled on it once in make test)."""
    first, standby = _taken_over(job, 9)
    standby.add_rank(0, resume_step=6)
    standby.add_rank(1, resume_step=6)
    standby.flush()
    assert standby.state.planner.state.next_step == 6
    for r in standby.ranks.values():  # steps 6..8 arrived from the old coordinator's workers meanwhile
        r.headers.update({k: v for k, v in first.ranks[r.rank].headers.items() if 6 <= k <= 8})
        r.consumed = 8
        standby.pending.append(Consumed(at=standby.now, peer=r.peer, rank=r.rank, step=8, waited_s=0.0))
    standby.run(STEPS + 4)
    assert {k: v for k, v in standby.stream(STEPS).items() if k[1] >= 9} == \
        {k: v for k, v in reference.items() if k[1] >= 9}
