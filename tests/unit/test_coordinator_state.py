"""The coordinator's state machine driven by scripted events (tests/unit/coordinator_driver.py):
no processes, no sockets, no clock. Assertions are on the instructions it returns and on the
stream the stand-in ranks receive."""

import numpy as np
import pytest

from coordinator import stimulus
from msd_common.spec import parse_job
from coordinator.events import (Consumed, HostHeartbeat, HostHello, MixRequest, Shutdown, Tick, TrainerHello,
                                WorkerHeartbeat)
from coordinator.history import StepHistory
from coordinator.instructions import AppendJournal, AppendMixture, Send, Stop
from coordinator.plan import Planner
from tests.conftest import job_dict
from msd_common import protocol as P
from msd_common.doc_keys import split_doc_key

from .coordinator_driver import Driver

STEPS = 10


@pytest.fixture(scope="module")
def job(dataset_dir):
    return parse_job(job_dict(), "job.yaml", base_dir=dataset_dir)


@pytest.fixture(scope="module")
def reference(job):
    d = Driver(job)
    d.add_worker("w0")
    d.add_rank(0)
    d.add_rank(1)
    d.run(STEPS)
    assert not d.unserved
    return d.stream(STEPS)


def _started(job, workers=("w0", "w1"), history=None, driver: type[Driver] = Driver) -> Driver:
    d = driver(job, history)
    for w in workers:
        d.add_worker(w)
    d.add_rank(0)
    d.add_rank(1)
    return d


def test_the_stream_does_not_depend_on_the_number_of_workers(job, reference):
    d = _started(job, ("w0", "w1", "w2"))
    d.run(STEPS)
    assert d.stream(STEPS) == reference and not d.unserved
    # and it is the planner's own plan: the recipes hold its pieces, rank by rank
    assert sum(len(v) for v in reference.values()) > 0


def test_the_journal_line_of_a_step_precedes_its_dispatch(job):
    d = _started(job, history=StepHistory(durable=True))
    d.run(3)
    kinds = [type(i).__name__ if not isinstance(i, Send) else i.message.TYPE for i in d.out]
    for step in range(3):
        journaled = next(k for k, i in enumerate(d.out) if isinstance(i, AppendJournal)
                         and any(s["next_step"] == step + 1 for s in i.states))
        first_header = next(k for k, i in enumerate(d.out) if isinstance(i, Send)
                            and i.message.TYPE == "step_header" and i.message.step == step)
        assert journaled < first_header, kinds[:first_header + 1]


def test_a_worker_dying_mid_delivery_has_its_records_prepared_again_and_the_deliveries_sent_in_step_order(
        job, reference):
    d = _started(job)
    victim = b"w1"
    lost_steps = []

    def die_once(driver, worker, ins):
        if worker.peer == victim and ins.message.step >= 4 and not lost_steps:
            lost_steps.append(ins.message.step)
            return "drop"  # killed with the delivery in hand: no pieces, no ack
        return None

    d.on_deliver = die_once
    d.run(4)
    before = len(d.out)
    d.run(STEPS)
    assert lost_steps and not d.workers[victim].alive
    after = d.out[before:]
    # the state noticed (3 silent heartbeats), re-prepared on the survivor, re-sent in step order
    reprepared = [i for i in d.sends(after, "prepare") if i.peer == b"w0"]
    assert reprepared
    to_w0 = [i.message.step for i in d.sends(after, "deliver") if i.peer == b"w0"]
    # w0's own deliveries of the steps planned before the death was noticed may come first; from
    # the first step sent to it again (the victim's part, from the copies w0 prepared again) on,
    # in step order
    again = next((k for k, step in enumerate(to_w0) if step in to_w0[:k]), 0)
    resent = to_w0[again:]
    assert resent == sorted(resent) and lost_steps[0] in resent, to_w0
    assert d.stream(STEPS) == reference and not d.unserved
    assert d.state.deliveries.counts()["orphaned"] == 0


def test_a_delivery_lost_after_its_ack_is_sent_again(job, reference):
    """A worker's ack means its socket queued the pieces, not that they arrived: a worker killed
    right after acknowledging loses them, and the coordinator sends them again from new copies."""
    d = _started(job)
    done = []

    def ack_then_die(driver, worker, ins):
        if worker.peer == b"w0" and ins.message.step == 3 and not done:
            done.append(ins.message.delivery_id)
            return "ack-then-die"
        return None

    d.on_deliver = ack_then_die
    d.run(STEPS)
    assert done and d.stream(STEPS) == reference and not d.unserved


def test_a_rank_resuming_from_an_older_step_rewinds_the_plan_and_gets_the_same_steps(job, reference):
    d = _started(job)
    d.run(7)
    assert d.state.planner.state.next_step > 7
    first_time = d.ranks[0].headers
    d.remove_rank(0)
    d.flush()
    d.add_rank(0, resume_step=3, name="rank0-restarted")  # a new trainer process, from a step-3 checkpoint
    out = d.flush()
    told = {i.peer for i in d.sends(out, "unknown_peer")}
    assert told == {b"w0", b"w1"}  # workers start clean: what they held was for the old plan
    assert 3 <= d.state.planner.state.next_step < 7  # planned again from step 3
    d.run(STEPS)
    assert all(np.array_equal(first_time[k], d.ranks[0].headers[k]) for k in range(3, 7))  # the same steps again
    d.ranks[0].headers.update({k: v for k, v in first_time.items() if k < 3})
    assert d.stream(STEPS) == reference and not d.unserved


def test_a_mix_request_is_journaled_before_it_is_answered_and_refused_for_a_planned_step(job):
    d = _started(job, history=StepHistory(durable=True))
    d.run(2)
    planned = d.state.planner.state.next_step
    ok = d.handle(MixRequest(at=d.now, peer=b"tool", at_step=planned + 5, weights={"web": 1, "code": 1}))
    kinds = [type(i).__name__ if not isinstance(i, Send) else i.message.TYPE for i in ok]
    assert kinds[:2] == ["AppendMixture", "mix_reply"] and ok[1].message.ok == 1
    assert ok[0] == AppendMixture(planned + 5, (1.0, 1.0, 0.0))
    assert d.state.planner.weights_at(planned + 5) == [0.5, 0.5, 0.0]
    late = d.handle(MixRequest(at=d.now, peer=b"tool", at_step=0, weights={"web": 1}))
    assert [i.message.ok for i in d.sends(late, "mix_reply")] == [0]
    assert "already planned" in d.sends(late, "mix_reply")[0].message.reason
    assert not any(isinstance(i, AppendMixture) for i in late)


def test_a_busy_auto_host_grows_while_ranks_wait(job):
    d = Driver(job)
    host = HostHello(at=0.0, peer=b"host", version=P.PROTOCOL_VERSION, agent_id=7, host="cpu-1", procs=1,
                     min_procs=1, max_procs=3, auto=1)
    out = d.handle(host)
    assert [(i.message.procs, i.message.reason) for i in d.sends(out, "scale")] == [(1, "registered")]
    d.add_worker("w0")
    d.add_rank(0)
    d.add_rank(1)
    d.flush()
    scales = []
    for k in range(1, 8):  # workers busy 90 % of the time, ranks waiting half of it
        d.now += 1.0
        beats = [WorkerHeartbeat(at=d.now, peer=b"w0", worker_id=0, cached_records=0, busy_s=0.9 * k)]
        beats += [Consumed(at=d.now, peer=f"rank{r}".encode(), rank=r, step=-1, waited_s=0.5 * k) for r in (0, 1)]
        beats += [HostHeartbeat(at=d.now, peer=b"host", agent_id=7, procs=1)]
        scales += d.sends(d.handle(*beats, Tick(at=d.now)), "scale")
    assert scales and scales[0].peer == b"host" and scales[0].message.procs == 2


def test_an_unknown_peer_is_asked_to_say_hello_and_a_bad_claim_is_dropped(job):
    d = _started(job, ("w0",))
    d.flush()
    out = d.handle(WorkerHeartbeat(at=0.0, peer=b"stranger", worker_id=0, cached_records=0, busy_s=0.0))
    assert [i.peer for i in d.sends(out, "unknown_peer")] == [b"stranger"]
    out = d.handle(WorkerHeartbeat(at=0.0, peer=b"w0", worker_id=99, cached_records=0, busy_s=0.0))
    assert not d.sends(out, "unknown_peer") and d.state.registry.workers[0].busy_s == 0.0
    bad = d.handle(TrainerHello(at=0.0, peer=b"r9", version=P.PROTOCOL_VERSION, rank=9, data_address="x",
                                resume_step=0, incarnation=1, metadata_only=0))
    assert "out of range" in d.sends(bad, "reject")[0].message.reason


def test_a_faulty_run_replays_exactly_from_its_stimulus_log(job, tmp_path):
    d = _started(job)
    log = stimulus.StimulusLog({"job_path": "job.yaml", "num_records": list(d.sources.num_records),
                                "durable": False, "loaded_states": [], "mixture_changes": []})
    handle = d.state.handle

    def logged(*events):
        out = handle(*events)
        log.record(list(events), out)
        return out

    d.state.handle = logged
    d.on_deliver = lambda drv, w, ins: "drop" if w.peer == b"w1" and ins.message.step == 5 else None
    d.run(STEPS)
    path = log.dump(str(tmp_path / "stimulus.msgpack"))
    dump = stimulus.load(path)
    assert dump.complete and len(dump.entries) == log.recorded
    result = stimulus.replay(dump, stimulus.build_state(dump, job=job, sources=d.sources))
    assert result.mismatch is None and result.bursts == log.recorded


def test_a_planning_error_stops_the_coordinator_with_the_reason(job, monkeypatch):
    d = _started(job)

    def broken(known):
        raise RuntimeError("boom")

    monkeypatch.setattr(d.state.planner, "plan_step", broken)
    out = d.flush()
    stops = [i for i in out if isinstance(i, Stop)]
    assert stops and stops[0].failed and "boom" in stops[0].reason
    assert not d.sends(out, "step_header")
    d.add_worker("w9")  # nothing more is decided after that, but peers are told of the shutdown
    assert d.flush() == [] and d.tick() == []
    assert {i.peer for i in d.sends(d.handle(Shutdown(at=d.now, reason="stop")), "shutdown")} >= {b"w0", b"w1"}


def test_the_planner_alone_gives_the_recipes_the_ranks_received(job, reference, dataset_dir):
    """The state adds no decision of its own to the plan: a bare Planner over the true lengths
    gives the same pieces."""
    d = Driver(job)
    planner = Planner(job, d.sources.num_records)
    readers = d.readers

    class Known:
        def window(self, source, start, count):
            records = planner.streams[source].records_array(start, count)
            lengths = []
            for r in records.tolist():
                try:
                    lengths.append(len(readers[source].read_sample(r)[0]))
                except Exception:
                    lengths.append(0)
            return records, np.asarray(lengths, dtype=np.int64)

        def patches(self, source, positions):
            return np.zeros(len(positions), dtype=np.int64)

        def patch_squares(self, source, positions):
            return np.zeros(len(positions), dtype=np.int64)

    for step in range(STEPS):
        plan = planner.plan_step(Known())
        for rank in (0, 1):
            pieces, _ = plan.rows_of_rank(rank)
            got = reference[(rank, step)]
            assert [row[1:] for row in got] == [[int(p[3]), int(p[4])] for p in pieces]


def test_the_stimulus_log_keeps_its_recent_past_within_its_bounds():
    prepare = P.Prepare(task_id=0, source=0, worker_id=0, records=np.zeros(100, np.uint64))
    burst = ([Tick(at=0.0)], [Send(b"p", prepare)])  # ~1.2 kB
    by_count = stimulus.StimulusLog({}, max_entries=5)
    by_bytes = stimulus.StimulusLog({}, max_bytes=3000)
    for _ in range(10):
        by_count.record(*burst)
        by_bytes.record(*burst)
    assert len(by_count.entries) == 5 and len(by_bytes.entries) == 2 and by_bytes.nbytes <= 3000
    assert not by_count.complete and by_count.recorded == 10


def _delivered(d: Driver) -> set[tuple[int, int]]:
    """(source, record) of every piece in the recipes the ranks received."""
    return {split_doc_key(row[0]) for recipe in d.stream().values() for row in recipe}


def test_a_record_that_kills_workers_is_narrowed_down_then_quarantined_after_three_deaths(job):
    from coordinator.instructions import AppendQuarantine

    d = _started(job, history=StepHistory(durable=True))
    d.add_host()
    poison = int(d.state.planner.streams[0].records_array(0, 1)[0])  # the web source's first record
    d.poison = {(0, poison)}
    d.run(STEPS)
    # a task of many records died first, then the record alone, twice more: 3 deaths, each on a
    # different worker process, then never handed out again
    assert len(d.deaths) == 3 and len({w for w, _ in d.deaths}) == 3
    quarantines = [i for i in d.out if isinstance(i, AppendQuarantine)]
    assert [(q.source, q.record) for q in quarantines] == [("web", poison)]
    assert d.state.status()["skipped_by_kind"]["web"]["quarantined"] >= 1
    assert (0, poison) not in _delivered(d)
    assert not d.unserved
    # A coordinator that starts with the quarantine journal gives the same stream with no death.
    again = Driver(job, quarantined=[("web", poison)])
    for w in ("w0", "w1"):
        again.add_worker(w)
    again.add_rank(0)
    again.add_rank(1)
    again.run(STEPS)
    assert again.stream(STEPS) == d.stream(STEPS)


def test_a_memory_mapped_record_over_max_record_bytes_is_skipped_from_its_index(dataset_dir):
    raw = job_dict()
    raw["sources"]["code"]["max_record_bytes"] = 600  # bytes: 300 uint16 tokens
    job = parse_job(raw, "job.yaml", base_dir=dataset_dir)
    d = _started(job)
    d.run(STEPS)
    lengths = d.readers[1].lengths(np.arange(d.readers[1].num_records))
    over = set(np.flatnonzero(lengths > 300).tolist())
    assert over
    delivered = {r for s, r in _delivered(d) if s == 1}
    assert delivered and not delivered & over
    assert d.state.status()["skipped_by_kind"]["code"]["over_limit"] >= 1


def test_a_coordinator_with_no_state_resumes_from_the_state_the_ranks_carry(job):
    from coordinator.events import StateRequest

    d = _started(job)
    d.run(2)
    d.handle(MixRequest(at=d.now, peer=b"tool", at_step=5, weights={"web": 1, "long": 3}))
    d.run(STEPS)
    [reply] = d.sends(d.handle(StateRequest(at=d.now, peer=b"rank0", rank=0, step=7)), "state_reply")
    carried = reply.message.state
    assert reply.message.ok == 1 and carried["mixture_changes"] == [[5, [1.0, 0.0, 3.0]]]

    fresh = Driver(job, StepHistory(durable=True))  # no state of the first run at all
    fresh.add_worker("w0")
    fresh.add_rank(0, resume_step=7, carried=carried)
    fresh.add_rank(1, resume_step=7, carried=carried)
    fresh.run(STEPS)
    first = d.stream(STEPS)
    assert fresh.stream(STEPS) == {k: v for k, v in first.items() if k[1] >= 7}
    # the state dir it writes starts from the carried state, with the mixture change
    compacted = [i for i in fresh.out if type(i).__name__ == "CompactJournal"]
    assert compacted and compacted[0].state == carried["planner"]
    assert any(isinstance(i, AppendMixture) and i.at_step == 5 for i in fresh.out)

    # a rank bringing another state for the same step is refused, saying why
    other = {**carried, "planner": {**carried["planner"], "cursors": [c + 1 for c in carried["planner"]["cursors"]]}}
    again = Driver(job)
    again.add_worker("w0")
    again.add_rank(0, resume_step=7, carried=carried)
    again.add_rank(1, resume_step=7, carried=other)
    rejects = again.sends(again.flush(), "reject")
    assert len(rejects) == 1 and "differs from the one the first rank brought" in rejects[0].message.reason
    # and a rank resuming ahead of a coordinator that has no state and gets none is refused too
    bare = Driver(job)
    bare.add_worker("w0")
    bare.add_rank(0, resume_step=7)
    [refused] = bare.sends(bare.flush(), "reject")
    assert "does not carry the coordinator's state" in refused.message.reason


def test_a_second_hello_of_the_same_client_before_it_consumed_anything_rewinds_nothing(job, reference):
    """A client says hello again when our welcome is slow to reach it (a coordinator busy with a
    thousand ranks). The same client (identity, data address, nothing consumed) is welcomed again;
    the plan is not rewound, and the stream is the same."""
    d = _started(job)
    for _ in range(50):  # workers prepare and the plan runs ahead; nobody consumes yet
        if d.state.planner.state.next_step > 0:
            break
        d.flush() if d.pending else d.tick()
    planned = d.state.planner.state.next_step
    assert planned > 0 and d.state.registry.trainers[0].consumed == -1
    rank0 = d.state.registry.trainers[0]
    again = TrainerHello(at=1.0, peer=rank0.identity, version=P.PROTOCOL_VERSION, rank=0,
                         data_address=rank0.address, resume_step=0, incarnation=rank0.incarnation, metadata_only=0)
    out = d.handle(again)
    assert [i.peer for i in d.sends(out, "trainer_welcome")] == [rank0.identity]
    assert not d.sends(out, "unknown_peer") and d.state.planner.state.next_step >= planned  # no rewind
    d.run(STEPS)
    assert d.stream(STEPS) == reference and not d.unserved


class _OneReportAtATime(Driver):
    """A driver whose ranks' consumed reports come one burst each (as at hundreds of ranks)."""

    def flush(self):
        events, self.pending = self.pending, []
        reports = [e for e in events if isinstance(e, Consumed)]
        out = self.handle(*[e for e in events if not isinstance(e, Consumed)])
        for e in reports:
            out += self.handle(e)
        return out


def test_rank_reports_that_leave_the_slowest_rank_where_it_was_skip_the_planning_pass_and_change_nothing(
        job, monkeypatch):
    from coordinator import state as state_module

    def run(skip: bool) -> tuple[list, int]:
        passes = []
        pump = state_module.CoordinatorState._pump
        monkeypatch.setattr(state_module.CoordinatorState, "_pump", lambda self: passes.append(1) or pump(self))
        monkeypatch.setattr(state_module, "_RANK_REPORTS", state_module._RANK_REPORTS if skip else ())
        d = _started(job, ("w0",), driver=_OneReportAtATime)
        d.run(STEPS)
        assert not d.unserved
        return d.out, len(passes)

    with_skip, passes_with = run(True)
    without, passes_without = run(False)
    assert passes_with < passes_without - STEPS // 2, (passes_with, passes_without)  # rank 0's reports skip it
    assert len(with_skip) == len(without)
    for a, b in zip(with_skip, without):
        assert type(a) is type(b)
        if isinstance(a, Send):
            assert a.peer == b.peer and a.message.header() == b.message.header()
            assert all(np.array_equal(x, y) for x, y in zip(a.message.frames(), b.message.frames()))


class _PacedRanks(Driver):
    """Ranks whose slowest takes one second per step; workers answer at once."""

    def _consume(self):
        slowest = min(r.consumed for r in self.ranks.values())
        super()._consume()
        self.now += min(r.consumed for r in self.ranks.values()) - slowest


def test_sources_keep_one_step_ahead_of_the_plan_when_their_round_trip_is_short(tmp_path, monkeypatch):
    from coordinator.lead import PrepareLead

    rng = np.random.default_rng(3)
    (tmp_path / "docs.jsonl").write_text("".join(
        '{"text": "%s"}\n' % ("x" * int(rng.integers(40, 160))) for _ in range(4000)))
    job = parse_job(job_dict(sources={"docs": {"format": "jsonl", "paths": ["docs.jsonl"], "tokenizer": "byte"}},
                             mixture={"weights": {"docs": 1.0}}), "job.yaml", base_dir=str(tmp_path))

    def run(whole_look_ahead: bool) -> tuple[int, Driver]:
        if whole_look_ahead:  # as every source did before lead.py
            monkeypatch.setattr(PrepareLead, "steps_ahead", lambda self: np.full(len(self.round_trip_s),
                                                                                 float(self.most)))
        d = _started(job, ("w0",), driver=_PacedRanks)
        held = []
        for steps in range(1, 31):
            d.run(steps)
            held.append(sum(n for w in d.workers.values() for n in w.cache.values()))
        monkeypatch.undo()
        assert not d.unserved
        return max(held[10:]), d

    narrow, d = run(False)
    wide, d_wide = run(True)
    assert d.stream(30) == d_wide.stream(30)
    lead = d.state.lead
    # the driver answers a task in the round after it was sent: at most a step's time
    assert 0.8 < lead.step_s < 1.2 and 1.0 <= lead.steps_ahead()[0] <= 2.05, (lead.step_s, lead.round_trip_s)
    assert d.state.status()["prepare_ahead_steps"] == {"docs": round(float(lead.steps_ahead()[0]), 2)}
    per_step = 8 * 512 / 100  # records: 8 rows of 512 tokens, documents of 100 bytes on average
    assert narrow < 3.5 * per_step < 4 * per_step < wide, (narrow, wide, per_step)


def test_a_status_is_logged_in_one_short_line_and_a_stop_writes_the_last_one(job):
    """Issue 48: the coordinator logged the whole status (about 2 KB) at every write; a job that
    ended left a status.json from up to 30 s before its end."""
    from coordinator.events import Shutdown
    from coordinator.instructions import WriteStatus
    from coordinator.status_view import status_line

    d = _started(job)
    d.add_host()
    d.run(STEPS)
    status = d.state.status()
    line = status_line(status)
    assert len(line) < 300 and len(str(status)) > 1000
    assert f"planned through step {status['next_step'] - 1}" in line and "2 rank(s)" in line
    out = d.handle(Shutdown(at=d.now, reason="coordinator stopping", failed="source 'web': it broke"))
    [last] = [i for i in out if isinstance(i, WriteStatus)]
    assert last.status["stopped"] == "coordinator stopping" and last.status["failed"] == "source 'web': it broke"
    assert "JOB FAILED: source 'web': it broke" in status_line(last.status)
    told = [s.message.header() for s in d.sends(out, "job_failed")]
    assert len(told) == 2 and all(h["reason"] == "source 'web': it broke" for h in told)
