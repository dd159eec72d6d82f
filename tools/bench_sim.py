"""How fast the simulation runs: simulated steps per CPU second at one DP size, fault-free (the
faulty runs of `msd.sim` cost about as much again: every seed also runs its reference), and
where the CPU goes, by role: in a second pass, each role's entry points are timed (thread CPU
time, exclusive: a role's time leaves out the roles it calls, such as the wire's decoding inside
a rank's handling), without a profiler, whose cost per call inflates code of many small calls.
What no role takes is the simulator's own: its event queue, network and shells.

    python tools/bench_sim.py --dp 8 --seeds 6 --steps 100 --json docs/results/issue58/bench-sim.json

Also the coordinator state's own CPU per simulated step (CoordinatorState.handle's thread time in
the unprofiled pass): the same events whatever the machine's load, so two trees compare without
a fleet's noise (with --per-relay, the ranks behind relays of that many ranks each).

    python tools/bench_sim.py --dp 1024 --per-relay 8 --seeds 1 --first-seed 3000 --steps 40 --no-shares
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msd.sim.run import Simulation, draw  # noqa: E402

# role -> the entry points (module, class or None, function) whose CPU is the role's
ROLES = {"coordinator state": [("coordinator.state", "CoordinatorState", "handle")],
         "books validated": [("msd.sim.roles", None, "validate_state")],
         "workers (WorkerCore)": [("worker.core", "WorkerCore", "handle")],
         "ranks (RankCore)": [("trainer_client.rank_core", "RankCore", f)
                              for f in ("on_control", "on_pieces", "command", "turn")],
         "relays (RelayCore)": [("relay.core", "RelayCore", f) for f in ("on_data", "on_up", "on_local", "turn")],
         "trainer: micro-batches built": [("trainer_client.assemble", "StepAssembler", "micro_batch")],
         "trainer: micro-batches digested": [("msd.sim.roles", None, "_digest")],
         "wire decode": [("msd_common.wire", None, "decode")],
         "wire encode": [("msd_common.wire", None, "encode")]}


def scenario(seed: int, dp: int, steps: int, per_relay: int = 0):
    s = draw(seed, steps).fault_free()
    s.job = copy.deepcopy(s.job)
    s.job["topology"] = {"dp": dp, "tp": 1}
    s.job["batch"]["global_batch_size"] = dp * s.job["batch"]["micro_batch_size"]
    s.ranks_per_relay = per_relay
    return s


class RoleClock:
    """While active, the thread CPU time of each role's entry points (ROLES, or those given) is
    summed, exclusive of the other entry points they call."""

    def __init__(self, roles: dict | None = None) -> None:
        self.roles = ROLES if roles is None else roles

    def __enter__(self) -> "RoleClock":
        self.seconds = dict.fromkeys(self.roles, 0.0)
        self.saved: list[tuple[object, str, object]] = []
        inner: list[float] = []  # per active entry point: the time of the entry points it called

        def timed(role, fn):
            def wrapper(*args, **kwargs):
                inner.append(0.0)
                started = time.thread_time()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent = time.thread_time() - started
                    self.seconds[role] += spent - inner.pop()
                    if inner:
                        inner[-1] += spent
            return wrapper

        for role, points in self.roles.items():
            for module, cls, name in points:
                owner = importlib.import_module(module)
                owner = getattr(owner, cls) if cls else owner
                fn = owner.__dict__[name] if cls else getattr(owner, name)
                self.saved.append((owner, name, fn))
                setattr(owner, name, timed(role, fn))
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--per-relay", type=int, default=0, help="ranks per relay (0: every rank direct)")
    ap.add_argument("--no-shares", action="store_true", help="skip the second pass (CPU by role)")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--first-seed", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    sims = [Simulation(scenario(seed, args.dp, args.steps, args.per_relay), args.steps, None) for seed in seeds]
    Simulation(scenario(args.first_seed, args.dp, 5), 5, None).run()  # warm: data written, sources opened
    cpu = time.process_time()
    with RoleClock({"coordinator state": ROLES["coordinator state"]}) as state_clock:  # one clock: no cost
        steps = sum(sim.run()["steps"] for sim in sims)
    cpu = time.process_time() - cpu
    by_role = {}
    if not args.no_shares:  # a second pass, its roles timed
        sims = [Simulation(scenario(seed, args.dp, args.steps, args.per_relay), args.steps, None) for seed in seeds]
        timed_cpu = time.process_time()
        with RoleClock() as clock:
            timed_steps = sum(sim.run()["steps"] for sim in sims)
        timed_cpu = time.process_time() - timed_cpu
        by_role = {role: round(1000 * spent / timed_steps, 3) for role, spent in clock.seconds.items()}
        by_role["the simulator (events, network, shells)"] = round(
            1000 * (timed_cpu - sum(clock.seconds.values())) / timed_steps, 3)
        by_role["total, timed pass (its clocks included)"] = round(1000 * timed_cpu / timed_steps, 3)
    out = {"dp": args.dp, "per_relay": args.per_relay, "seeds": args.seeds, "steps": steps, "cpu_s": round(cpu, 2),
           "steps_per_cpu_s": round(steps / cpu, 1), "ms_per_step": round(1000 * cpu / steps, 2),
           "coordinator_state_ms_per_step": round(1000 * state_clock.seconds["coordinator state"] / steps, 2),
           "ms_per_step_by_role": by_role}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
