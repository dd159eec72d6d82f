"""One seed: draw a job and its faults, run it fault-free for the reference stream, run it again
with the faults, and check the invariants:

- each rank's every step, micro-batch by micro-batch, is the fault-free run's (doc keys,
  offsets, lengths and the digest of every array the trainer gets), handed over once and in order;
- the job never stops, and no step is left waiting: once the faults are over, progress resumes
  within `STALL_S` simulated seconds;
- the coordinator's books agree (coordinator.validate) after every burst it handles.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from coordinator.sources import open_sources
from msd_common.spec import JobConfig, parse_job

from . import data
from .roles import COORDINATOR, SimCoordinator, SimHost, SimRelay, SimTrainer, Violation
from .world import World

EVAL_SET = "heldout"
STALL_S = 60.0  # simulated seconds without a step, after the last fault healed, that count as a stall
FAULT_KINDS = ("worker_crash", "host_lost", "partition", "queue_full", "congestion", "slow_worker", "trainer_restart",
               "trainer_pause", "coordinator_crash", "coordinator_stop", "coordinator_pause", "relay_crash")


@dataclass
class Scenario:
    seed: int
    job: dict[str, Any]
    hosts: list[int]  # worker processes per host
    compute_s: float
    checkpoint_every: int
    delay_s: tuple[float, float]
    duplicate_p: float
    slow_every: int  # records whose index % slow_every == the seed's residue take seconds (0: none)
    faults: list[tuple[float, str, float, float]] = field(default_factory=list)  # (at, kind, pick, seconds)
    ranks_per_relay: int = 0  # trainer ranks per host behind a relay (0: no relays)
    eval_every: int = 0  # every this many steps, each rank takes a pass over the eval set (0: no eval set)

    def fault_free(self) -> "Scenario":
        return Scenario(self.seed, self.job, self.hosts, self.compute_s, self.checkpoint_every, (0.0005, 0.001), 0.0,
                        self.slow_every, [], self.ranks_per_relay, self.eval_every)


def draw(seed: int, steps: int, faults: bool = True, later: bool = True) -> Scenario:
    """The seed's job (sources, DP 2 to 16, TP in some, batch shape, look-ahead, an eval set in
    some), its workers, and its faults (an elastic resume at another DP in some). later False: the
    scenario as drawn before eval sets and elastic resumes were (drawn apart, so that the regression
    seeds found before replay their own scenario)."""
    rng = random.Random(seed)
    names = [n for n in data.SOURCES if rng.random() < 0.7] or [rng.choice(list(data.SOURCES))]
    dp = rng.choice([2, 2, 4, 4, 8, 8, 16])
    tp = rng.choice([1, 1, 2]) if dp <= 4 else 1
    relays = rng.random() < 0.4
    delivery = "all" if tp > 1 and relays and rng.random() < 0.5 else "tp_leader"
    mbs, n_mb = rng.choice([1, 2]), rng.choice([1, 1, 2])
    job = {
        "seed": rng.randrange(1 << 20),
        "sources": {n: data.SOURCES[n] for n in names},
        "batch": {"seq_len": rng.choice([128, 256, 512]), "micro_batch_size": mbs,
                  "global_batch_size": dp * mbs * n_mb},
        "topology": {"dp": dp, "tp": tp, "delivery": delivery},
        "mixture": {"weights": {n: round(rng.uniform(0.1, 1.0), 2) for n in names}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": rng.choice([4, 8, 16, 32]),
                    "lookahead_steps": rng.choice([1, 2, 3, 4])},
    }
    compute_s = rng.choice([0.01, 0.05, 0.2])
    s = Scenario(seed, job, [rng.randint(1, 3) for _ in range(rng.randint(1, 3))], compute_s, rng.choice([5, 10, 25]),
                 (0.0005, rng.choice([0.001, 0.005, 0.05])), rng.choice([0.0, 0.0, 0.05]),
                 rng.choice([0, 0, 200, 500]), ranks_per_relay=rng.choice([2, 4, 8]) if relays else 0)
    # An eval set in some seeds, drawn apart (the seeds drawn before eval sets keep their jobs and faults
    # when they draw none): a share of a training source held out, a pass every few steps.
    extra = random.Random(seed ^ 0xE7A1)
    if later and extra.random() < 0.3:
        s.job["eval"] = {EVAL_SET: {"holdout": {names[0]: 0.05}}}
        s.eval_every = extra.choice([3, 5, 8])
    # The job restarted at another DP from its checkpoint (coordinator and trainer; relays and TP
    # keep their DP here): the same global stream, spread over the new ranks.
    if later and faults and not s.ranks_per_relay and tp == 1 and extra.random() < 0.25:
        window = max(2.0, steps * (compute_s + 0.02) * 0.6)
        s.faults.append((round(extra.uniform(0.3, window), 4), "elastic_resume", extra.random(),
                         round(extra.uniform(0.5, 4.0), 3)))
    if faults:
        window = max(2.0, steps * (compute_s + 0.02) * 0.6)
        for _ in range(rng.randint(1, 6)):
            s.faults.append((round(rng.uniform(0.3, window), 4), rng.choice(FAULT_KINDS), rng.random(),
                             round(rng.uniform(0.2, 8.0), 3)))
    s.faults.sort()
    return s


_opened: dict[tuple, Any] = {}


def _job_of(scenario: Scenario) -> tuple[JobConfig, Any]:
    job = parse_job(scenario.job, "sim-job.yaml", base_dir=data.dataset_dir())
    key = tuple(sorted(scenario.job["sources"]))
    if key not in _opened:
        _opened[key] = open_sources(job)
    return job, _opened[key]


class Simulation:
    def __init__(self, scenario: Scenario, steps: int, reference: dict | None, trace: bool = False) -> None:
        self.scenario = scenario
        self.steps = steps
        self.reference = reference
        self.job, self.sources = _job_of(scenario)
        # Steps compared over all ranks, document by document, too (a job that resumes at another
        # DP, and the fault-free run it is compared with): set by run_seed
        self.global_check = False
        self.dp_changed = False  # per-rank streams are compared only at the DP of the fault-free run
        self.plan_digest = None
        self.world = World(scenario.seed)
        self.world.delay_s = scenario.delay_s
        self.world.duplicate_p = scenario.duplicate_p
        self.verbose = trace
        self.messages: dict[str, int] = {}
        self.coordinator = SimCoordinator(self)
        self.hosts = [SimHost(self, i, procs) for i, procs in enumerate(scenario.hosts)]
        ranks = sorted(self.job.topology.receivers())
        per = scenario.ranks_per_relay
        self.relays = [SimRelay(self, i) for i in range(-(-self.job.topology.world_size // per))] if per else []
        self.trainer = SimTrainer(self, ranks, scenario.compute_s, scenario.checkpoint_every, scenario.eval_every,
                                  EVAL_SET)
        self.last_progress = 0.0
        self.healed_at = 0.0  # when the last fault is over
        rng = random.Random(scenario.seed ^ 0x5EED)
        self.slow_residue = rng.randrange(max(1, scenario.slow_every))

    # ------------------------------------------------------------------ hooks the roles call

    def relay_of(self, rank: int) -> str | None:
        """The address of the relay of the rank's host (ranks_per_relay ranks a host), if relays serve."""
        return self.relays[rank // self.scenario.ranks_per_relay].address if self.relays else None

    def count(self, kind: str) -> None:
        self.messages[kind] = self.messages.get(kind, 0) + 1
        if self.verbose:
            self.world.log(f"coordinator sends {kind}")

    def sample_cost(self, source: int, records: np.ndarray, slower: float = 1.0) -> float:
        """Seconds a worker takes over these records: a fraction of a millisecond each (times
        `slower`, a worker slowed down: a fault), and seconds for the seed's slow records (a property
        of the data: the same in the fault-free run; far below max_sample_s)."""
        cost = 0.0003 * len(records) * slower
        if self.scenario.slow_every:
            slow = int(np.count_nonzero(records % self.scenario.slow_every == self.slow_residue))
            cost += 3.0 * slow
        return cost

    def check_step(self, rank: int, step: int, digests: list[str]) -> None:
        """A step's micro-batches as the fault-free run trained them (step -1: an eval pass's, the
        same at every pass)."""
        if self.reference is None or self.dp_changed:
            return
        want = self.reference.get((rank, step))
        if want is None:
            return
        if digests != want:
            m = next((i for i, (a, b) in enumerate(zip(digests, want)) if a != b), min(len(digests), len(want)))
            what = f"step {step}" if step >= 0 else "eval pass"
            raise Violation(f"rank {rank} {what}: micro-batch {m} differs from the fault-free run's")

    def check_global(self, key: Any, digest: list) -> None:
        """A step's (or an eval pass's) documents over all ranks, each one's tokens in that step, as
        in the fault-free run, whatever the DP."""
        if self.reference is None:
            return
        want = self.reference.get(key)
        if want is not None and digest != want:
            what = f"step {key[1]}" if key[1] >= 0 else "an eval pass"
            missing = sorted(set(map(tuple, want)) - set(map(tuple, digest)))[:3]
            raise Violation(f"{what}: the documents over all ranks differ from the fault-free run's "
                            f"(at DP {self.job.dp}; missing {missing})")

    def progress(self, step: int) -> None:
        self.last_progress = self.world.now
        self.world.log(f"step {step - 1} trained")

    # ------------------------------------------------------------------ the run

    def run(self) -> dict[str, Any]:
        world = self.world
        logging.getLogger("msd").setLevel(logging.CRITICAL)
        self.coordinator.start()
        for host in self.hosts:
            host.start()
        for relay in self.relays:
            relay.start()
        self.trainer.start()
        for at, kind, pick, seconds in self.scenario.faults:
            world.at(at, self._fault, kind, pick, seconds)
            self.healed_at = max(self.healed_at, at + seconds)
        world.after(5.0, self._watchdog)
        limit = self.healed_at + STALL_S + self.steps * (self.scenario.compute_s + 1.0)
        error: str | None = None
        try:
            done = world.run_until(limit, lambda: self.trainer.step >= self.steps, self.coordinator.validate_if_due)
            if not done:
                raise Violation(f"not done by {limit:.0f}s simulated: the trainer is at step {self.trainer.step} of "
                                f"{self.steps}")
        except Violation as e:
            error = str(e)
            world.log(f"VIOLATION {error}")
        stream = hashlib.blake2b(digest_size=16)
        for key in sorted(self.trainer.stream):
            stream.update(repr((key, self.trainer.stream[key])).encode())
        digest = hashlib.blake2b((world.digest + stream.hexdigest()).encode(), digest_size=16).hexdigest()
        return {"seed": self.scenario.seed, "steps": self.trainer.step, "faults": len(self.scenario.faults),
                "digest": digest, "ok": error is None, "error": error, "sim_s": round(world.now, 3),
                "events": world.events, "dp": self.job.dp, "ranks": len(self.trainer.rank_ids),
                "eval_passes": self.trainer.evaluated}

    def _watchdog(self) -> None:
        now = self.world.now
        if now > self.healed_at + STALL_S and now - max(self.last_progress, self.healed_at) > STALL_S:
            raise Violation(f"stalled: no step trained for {now - max(self.last_progress, self.healed_at):.0f}s "
                            f"simulated since the faults healed; the trainer waits for step {self.trainer.step}")
        self.world.after(5.0, self._watchdog)

    def _fault(self, kind: str, pick: float, seconds: float) -> None:
        world = self.world
        workers = [w for h in self.hosts for w in h.workers if w.alive]
        if kind == "worker_crash" and workers:
            workers[int(pick * len(workers))].crash()
        elif kind == "host_lost":
            hosts = [h for h in self.hosts if h.up]
            if len(hosts) > 1:  # (a job whose only host is lost waits for a new one: a restart below)
                host = hosts[int(pick * len(hosts))]
                host.lose()
                world.after(seconds, self._replace_host, host)
        elif kind in ("partition", "queue_full", "congestion"):
            peers = [*workers, *[h for h in self.hosts if h.up], *self.trainer.ranks.values(),
                     *[r for r in self.relays if r.core is not None]]
            if not peers:
                return
            peer = peers[int(pick * len(peers))]
            if kind == "partition":  # the connection breaks: what is on its way is lost; ZeroMQ reconnects
                world.log(f"FAULT connection of {peer.address} to the coordinator broken for {seconds:.1f}s")
                for src, dst in ((peer.address, COORDINATOR), (COORDINATOR, peer.address)):
                    world.block(src, dst, world.now + seconds)
                world.after(seconds, peer.connection_lost)  # its monitor saw the connection close
            elif kind == "queue_full":  # one side's queue to the other is full: its sends are dropped
                ways = [(peer.address, COORDINATOR), (COORDINATOR, peer.address)]
                src, dst = ways[int(pick * 1000) % 2]
                world.log(f"FAULT {src}'s queue to {dst} full for {seconds / 4:.1f}s")
                world.block(src, dst, world.now + seconds / 4, visible=True)
            else:
                ways = [(peer.address, COORDINATOR), (COORDINATOR, peer.address)][:1 + int(pick * 1000) % 2]
                for src, dst in ways:
                    world.congest(src, dst, world.now + seconds, seconds / 2)
                world.log(f"FAULT congestion of {ways} for {seconds:.1f}s")
        elif kind == "slow_worker" and workers:
            w = workers[int(pick * len(workers))]
            w.slow = 1000.0
            world.log(f"FAULT worker {w.address} slow for {seconds:.1f}s")
            world.after(seconds, setattr, w, "slow", 1.0)
        elif kind == "trainer_restart":
            self.trainer.restart(seconds)
        elif kind == "trainer_pause":
            world.log(f"FAULT trainer pauses for {seconds * 4:.1f}s")
            self.trainer.paused_until = world.now + seconds * 4
        elif kind == "coordinator_crash" and self.coordinator.up:
            self.coordinator.crash()
            world.after(seconds, self.coordinator.start)
        elif kind == "coordinator_stop" and self.coordinator.up:
            self.coordinator.stop()
            world.after(seconds / 4, self.coordinator.start)
        elif kind == "relay_crash" and self.relays:
            relay = self.relays[int(pick * len(self.relays))]
            if relay.core is not None:
                relay.crash(seconds / 4)
        elif kind == "elastic_resume":
            self._elastic_resume(pick, seconds)
        elif kind == "coordinator_pause" and self.coordinator.up:
            world.log(f"FAULT coordinator pauses for {seconds:.1f}s")
            self.coordinator.paused_until = world.now + seconds

    def _elastic_resume(self, pick: float, seconds: float) -> None:
        """The job stops (the coordinator gracefully, the trainer's processes), its job file gets
        another DP, and both start again: the coordinator from its state dir, the new ranks from
        the trainer's last checkpoint."""
        if self.trainer.step >= self.steps:
            return
        if not self.coordinator.up or not self.trainer.ranks or not self.trainer.checkpoint:
            self.world.after(0.5, self._elastic_resume, pick, seconds)  # from a checkpoint past step 0
            return
        self.healed_at = max(self.healed_at, self.world.now + seconds)
        batch = self.scenario.job["batch"]
        rows = batch["global_batch_size"] // batch["micro_batch_size"]  # micro-batches of a step, all ranks
        choices = [d for d in range(2, 17) if rows % d == 0 and d != self.job.dp]
        if not choices:
            return
        dp = choices[int(pick * len(choices))]
        self.world.log(f"FAULT elastic resume: DP {self.job.dp} -> {dp}, from step {self.trainer.checkpoint}")
        raw = copy.deepcopy(self.scenario.job)
        raw["topology"] = {**raw["topology"], "dp": dp}
        self.job = parse_job(raw, "sim-job.yaml", base_dir=data.dataset_dir())
        self.dp_changed = True
        self.coordinator.stop()
        self.trainer.restart(seconds, sorted(self.job.topology.receivers()))
        self.world.after(seconds / 2, self.coordinator.start)

    def _replace_host(self, old: SimHost) -> None:
        host = SimHost(self, old.index, old.procs)
        host.agent_id = old.agent_id + 1000
        host.next_pid = old.next_pid + 100
        self.hosts[self.hosts.index(old)] = host
        self.world.log(f"host {old.index} is back")
        host.start()


def run_seed(seed: int, steps: int, trace: bool = False, later: bool = True) -> tuple[dict[str, Any], list[str]]:
    """The seed's result (JSON-able) and its trace."""
    scenario = draw(seed, steps, later=later)
    reference_sim = Simulation(scenario.fault_free(), steps, None)
    reference_sim.global_check = any(kind == "elastic_resume" for _, kind, _, _ in scenario.faults)
    reference = reference_sim.run()
    if not reference["ok"]:
        result = dict(reference, error=f"the fault-free run failed: {reference['error']}")
        return result, reference_sim.world.trace
    sim = Simulation(scenario, steps, reference_sim.trainer.stream, trace)
    sim.global_check = reference_sim.global_check
    return sim.run(), sim.world.trace
