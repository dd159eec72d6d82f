"""The deterministic simulation (msd/sim, issue 58): whole jobs (the coordinator's state machine, the
workers' WorkerCore, the relays' RelayCore, the ranks' RankCore) under simulated time and a
simulated network, with faults drawn from each seed. Every seed must hold its invariants; a
fixed corpus (with the seeds of the bugs it found) and fresh seeds run on every `make test`."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from msd.sim import __main__ as cli
from msd.sim import run as simrun
from msd.sim.run import Simulation, draw, run_seed
from msd_common import protocol as P
from msd_common import wire
from relay.core import MoveOn, RelayCore
from trainer_client.rank_core import RankCore

STEPS = 30
# Seeds of the bugs the simulation found (each failed before its fix when it was found, at STEPS steps):
# 1024, 1076: a connection broken (or a send dropped) while work was in flight, and nobody the
#             wiser: the coordinator waited for good on a delivery the worker never got
# 104370, 109313, 109467, 109641 (of the 10,000-seed run): the simulator's own model (a full send
#             queue dropped messages already on the wire, which their sender could not know)
# (run as drawn when they were found: before the simulation drew eval sets and elastic resumes)
REGRESSIONS = (1024, 1076, 104370, 109313, 109467, 109641)
# Found since, with eval sets:
# 2000:       a holdout flooded the workers with prepare tasks (test_a_holdout_does_not_flood_...)
# 2916402189, 2916402254: an eval pass every rank had by the time its relay (or the rank) came back
#             was never released, and the ranks waiting for the next pass waited for good
# 201540:     a pass served unasked to a rank that then restarted its evaluation: when asked again, its
#             pieces that came before its header were dropped as copies of a pass taken
# 1640698392: (the simulator's own check) an elastic resume to DP 16 with a small source whose
#             document came twice to one step, in two epochs: its pieces, cut otherwise across rows
#             at DP 16, were joined in a different order; documents() now digests each token by
#             its position in the document, counted, whatever the cut
REGRESSIONS_LATER = (2000, 2916402189, 2916402254, 201540, 1640698392)
CORPUS = tuple(range(2000, 2060))
FRESH = 30


@pytest.fixture(autouse=True)
def _sim_data(tmp_path_factory, monkeypatch):
    # one dataset for the whole session (its shards are indexed once, beside them)
    monkeypatch.setenv("MSD_SIM_DATA", str(tmp_path_factory.getbasetemp() / "sim-data"))


def _failures(seeds, later: bool = True) -> list[str]:
    out = []
    for seed in seeds:
        result, trace = run_seed(seed, STEPS, later=later)
        if not result["ok"]:
            out.append(f"seed {seed}: {result['error']}\n" + "\n".join(trace[-30:]) +
                       f"\nreplay: python -m msd.sim --seeds 1 --first-seed {seed} --steps {STEPS} --trace")
    return out


def test_the_seeds_of_the_bugs_it_found_hold():
    assert _failures(REGRESSIONS, later=False) == []
    assert _failures(REGRESSIONS_LATER) == []


def test_a_fixed_corpus_of_seeds_holds():
    assert _failures(CORPUS) == []


def test_fresh_seeds_hold():
    first = int.from_bytes(os.urandom(4), "little")
    print(f"fresh seeds {first}..{first + FRESH - 1}")
    assert _failures(range(first, first + FRESH)) == []


def test_the_corpus_draws_every_kind_of_fault_and_job():
    scenarios = [draw(seed, STEPS) for seed in CORPUS]
    kinds = {kind for s in scenarios for _, kind, _, _ in s.faults}
    assert kinds == {*simrun.FAULT_KINDS, "elastic_resume"}
    assert {s.job["topology"]["dp"] for s in scenarios} == {2, 4, 8, 16}
    assert any(s.ranks_per_relay for s in scenarios) and any(not s.ranks_per_relay for s in scenarios)
    assert any(s.job["topology"]["tp"] > 1 for s in scenarios)
    assert any(s.slow_every for s in scenarios) and any(s.duplicate_p for s in scenarios)
    assert any(s.eval_every for s in scenarios) and any(not s.eval_every for s in scenarios)


def test_the_same_seed_gives_the_same_trace():
    first, trace = run_seed(2003, 20)
    again, trace_again = run_seed(2003, 20)
    assert first["ok"] and first["digest"] == again["digest"] and trace == trace_again
    assert run_seed(2004, 20)[0]["digest"] != first["digest"]


def _with_and_without(seed: int, patch, monkeypatch) -> dict:
    """The seed's faulty run with `patch` applied after its fault-free reference ran clean."""
    scenario = draw(seed, STEPS)
    reference = Simulation(scenario.fault_free(), STEPS, None)
    assert reference.run()["ok"]
    patch(monkeypatch)
    return Simulation(scenario, STEPS, reference.trainer.stream).run()


def test_a_worker_that_sends_a_wrong_token_is_caught(monkeypatch):
    from worker import core

    def patch(mp):
        real = core.WorkerCore._on_deliver

        def wrong(self, msg):
            out = real(self, msg)
            for a in out:
                if isinstance(a, core.ToRank) and msg.step == 7:
                    a.message.tokens[0] ^= 1  # one token of step 7
            return out

        mp.setattr(core.WorkerCore, "_on_deliver", wrong)

    result = _with_and_without(2001, patch, monkeypatch)
    assert not result["ok"] and "step 7: micro-batch" in result["error"] and "differs" in result["error"]


def test_a_lost_delivery_is_caught_as_a_stall(monkeypatch):
    from coordinator import layout

    def patch(mp):
        real = layout.StepLayout.deliver

        def lossy(self, step, *args):
            out = real(self, step, *args)
            return out[1:] if step == 5 else out  # one worker's deliver of step 5 never leaves

        mp.setattr(layout.StepLayout, "deliver", lossy)

    result = _with_and_without(2001, patch, monkeypatch)
    assert not result["ok"] and result["error"].startswith("stalled"), result["error"]


def test_books_that_disagree_are_caught(monkeypatch):
    from coordinator import tasks

    def patch(mp):
        real = tasks.TaskBook.complete

        def forgetful(self, task_id, worker_id):
            task = real(self, task_id, worker_id)
            if task is not None and task_id == 3:
                self._by_worker.setdefault(worker_id, set()).add(task_id)  # still counted as the worker's
            return task

        mp.setattr(tasks.TaskBook, "complete", forgetful)

    result = _with_and_without(2001, patch, monkeypatch)
    assert not result["ok"] and "books disagree" in result["error"] and "task 3" in result["error"]


def test_a_relay_carries_on_when_the_coordinator_stops():
    """Until issue 58 a relay with one coordinator address exited 2 s after a shutdown: a graceful
    restart of the coordinator left its ranks without a relay (found by msd.sim)."""
    core = RelayCore("tcp://relay:1", "ipc://local", "host", 1)
    out = core.on_up(wire.encode(P.make(P.Shutdown, reason="SIGTERM")), now=10.0)
    assert out == [MoveOn()]
    core.turn(100.0)
    assert core.running and core.stop_at is None


def test_a_rank_whose_connection_broke_says_hello_as_a_new_incarnation():
    """What was on its way is lost: its hello makes the coordinator plan again from its step."""
    core = RankCore(3, 5, 0, None, data_address="tcp://rank:1", incarnation=41)
    assert core.registration.due(0.0).incarnation == 41
    core.registration.welcomed(1.0)
    core.connection_lost("the connection broke")
    hello = core.registration.due(0.5)
    assert isinstance(hello, P.TrainerHello) and hello.incarnation == 42 and hello.resume_step == 5


def test_the_command_writes_its_json_and_fails_on_a_violation(tmp_path, monkeypatch):
    out = tmp_path / "sim.json"
    proc = subprocess.run([sys.executable, "-m", "msd.sim", "--seeds", "2", "--first-seed", "2010", "--steps", "10",
                           "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(out.read_text())
    assert [s["seed"] for s in summary["seeds"]] == [2010, 2011]
    assert all(set(s) >= {"seed", "steps", "faults", "digest", "ok"} and s["ok"] for s in summary["seeds"])
    assert summary["failed"] == [] and summary["steps_per_cpu_s"] > 0

    def failing(seed, steps, trace=False):
        raise_at = ["   1.0000 FAULT worker w0.1001 crashes",
                    "   2.0000 VIOLATION rank 0 step 3: micro-batch 0 differs"]
        return {"seed": seed, "steps": 3, "faults": 1, "digest": "x", "ok": False,
                "error": "rank 0 step 3: micro-batch 0 differs from the fault-free run's"}, raise_at

    monkeypatch.setattr(cli, "run_seed", failing)
    result = CliRunner().invoke(cli.main, ["--seeds", "1", "--first-seed", "77", "--steps", "5"])
    assert result.exit_code == 1
    assert "seed 77 FAILED: rank 0 step 3" in result.output and "FAULT worker w0.1001 crashes" in result.output
    assert "replay: python -m msd.sim --seeds 1 --first-seed 77 --steps 5 --trace" in result.output


def test_a_holdout_does_not_flood_the_workers_with_prepare_tasks():
    """Found by msd.sim once it drew eval sets (seed 2000): the records an eval set holds out are
    settled at length 0 before any worker answers, and the mean length they made (0) sized the
    prepare-ahead window at a step's tokens / 1 record: 64 times the tasks, the workers' queues
    full of them, and at DP 8 no step trained within a minute. The job file and the run are
    otherwise the same."""
    def prepares(holdout: bool) -> int:
        s = draw(2000, 10, later=False).fault_free()
        s.job = copy.deepcopy(s.job)
        s.job["sources"] = {"web": s.job["sources"]["web"]}
        s.job["mixture"] = {"weights": {"web": 1.0}}
        s.job["topology"] = {"dp": 8, "tp": 1}
        s.job["batch"]["global_batch_size"] = 16
        if holdout:
            s.job["eval"] = {"heldout": {"holdout": {"web": 0.05}}}
        s.slow_every = 0
        sim = Simulation(s, 10, None)
        assert sim.run()["ok"]
        return sim.messages["prepare"]

    without, held = prepares(False), prepares(True)
    assert held <= 2 * without, (held, without)


def test_an_elastic_resume_is_compared_over_all_ranks_document_by_document():
    """At another DP the ranks' micro-batches differ from the fault-free run's; the steps' documents
    over all ranks do not. A document missing from a step after the resume is caught."""
    scenario = draw(2003, STEPS)
    assert any(kind == "elastic_resume" for _, kind, _, _ in scenario.faults)
    reference = Simulation(scenario.fault_free(), STEPS, None)
    reference.global_check = True
    assert reference.run()["ok"]
    stream = dict(reference.trainer.stream)
    last = max(step for rank, step in stream if rank == -1)
    assert len(stream[(-1, last)]) > 1
    stream[(-1, last)] = stream[(-1, last)][1:]
    sim = Simulation(scenario, STEPS, stream)
    sim.global_check = True
    result = sim.run()
    assert sim.dp_changed and sim.job.dp != reference.job.dp
    assert not result["ok"] and f"step {last}: the documents over all ranks differ" in result["error"]


def test_a_rank_says_once_that_the_coordinator_forgot_it(caplog):
    """Issue 61: eight "coordinator does not know this rank" lines per rank after a relay restart
    (every heartbeat until its hello was answered drew another unknown_peer)."""
    import logging

    core = RankCore(3, 0, 0, None, data_address="tcp://rank:1", incarnation=1)
    welcome = wire.encode(P.TrainerWelcome(rank=3, batch={"micro_batch_size": 1, "micro_batches": 1, "pad_id": 0,
                                                          "topology": {"dp": 4}}, plan_digest="d", heartbeat_s=1.0))
    unknown = wire.encode(P.UnknownPeer(reason="the relay registered again"))
    with caplog.at_level(logging.INFO, logger="msd.client"):
        core.on_control(welcome, 0.0)
        for t in range(8):
            core.on_control(unknown, 1.0 + t)
        core.on_control(welcome, 10.0)
        core.on_control(unknown, 11.0)
    said = [r for r in caplog.records if "does not know this rank" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.WARNING, logging.WARNING], [r.getMessage() for r in said]
