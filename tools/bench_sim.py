"""How fast the simulation runs: simulated steps per CPU second at one DP size, fault-free (the
faulty runs of `msd.sim` cost about as much again: every seed also runs its reference), and
where the CPU goes, by role (cProfile's cumulative time of each role's entry point).

    python tools/bench_sim.py --dp 8 --seeds 6 --steps 100 --json docs/results/issue58/bench-sim.json

Also the coordinator state's own CPU per simulated step (CoordinatorState.handle's thread time in
the unprofiled pass): the same events whatever the machine's load, so two trees compare without
a fleet's noise (with --per-relay, the ranks behind relays of that many ranks each).

    python tools/bench_sim.py --dp 1024 --per-relay 8 --seeds 1 --first-seed 3000 --steps 40 --no-shares
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import json
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from msd.sim.run import Simulation, draw  # noqa: E402

# role -> (file suffix, function) whose cumulative time is the role's
ROLES = {"coordinator state": ("coordinator/state.py", "handle"),
         "books validated": ("coordinator/validate.py", "validate_state"),
         "workers (WorkerCore)": ("worker/core.py", "handle"),
         "ranks (RankCore: control)": ("trainer_client/rank_core.py", "on_control"),
         "ranks (RankCore: pieces)": ("trainer_client/rank_core.py", "on_pieces"),
         "trainer: micro-batches built": ("trainer_client/receiving.py", "micro_batch"),
         "trainer: micro-batches digested": ("msd/sim/roles.py", "_digest"),
         "wire decode": ("msd_common/wire.py", "decode"),
         "wire encode": ("msd_common/wire.py", "encode")}


def scenario(seed: int, dp: int, steps: int, per_relay: int = 0):
    s = draw(seed, steps).fault_free()
    s.job = copy.deepcopy(s.job)
    s.job["topology"] = {"dp": dp, "tp": 1}
    s.job["batch"]["global_batch_size"] = dp * s.job["batch"]["micro_batch_size"]
    s.ranks_per_relay = per_relay
    return s


class StateClock:
    """While active, CoordinatorState.handle's thread time is summed."""

    def __enter__(self) -> "StateClock":
        from coordinator.state import CoordinatorState

        self.seconds, self.handle = 0.0, CoordinatorState.handle
        clock = self

        def timed(state, *events):
            started = time.thread_time()
            try:
                return clock.handle(state, *events)
            finally:
                clock.seconds += time.thread_time() - started

        CoordinatorState.handle = timed
        return self

    def __exit__(self, *exc) -> None:
        from coordinator.state import CoordinatorState

        CoordinatorState.handle = self.handle


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--per-relay", type=int, default=0, help="ranks per relay (0: every rank direct)")
    ap.add_argument("--no-shares", action="store_true", help="skip the profiled pass (the shares by role)")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--first-seed", type=int, default=3000)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    sims = [Simulation(scenario(seed, args.dp, args.steps, args.per_relay), args.steps, None) for seed in seeds]
    Simulation(scenario(args.first_seed, args.dp, 5), 5, None).run()  # warm: data written, sources opened
    cpu = time.process_time()
    with StateClock() as state_clock:
        steps = sum(sim.run()["steps"] for sim in sims)
    cpu = time.process_time() - cpu
    shares = {}
    if not args.no_shares:
        profile = cProfile.Profile()  # a second pass, profiled, for the shares
        profile.enable()
        for seed in seeds:
            Simulation(scenario(seed, args.dp, args.steps, args.per_relay), args.steps, None).run()
        profile.disable()
        stats = pstats.Stats(profile).stats
        total = max(v[3] for v in stats.values())
        for role, (suffix, name) in ROLES.items():
            cum = sum(v[3] for (f, _, n), v in stats.items() if f.endswith(suffix) and n == name)
            shares[role] = round(cum / total, 3)
    out = {"dp": args.dp, "per_relay": args.per_relay, "seeds": args.seeds, "steps": steps, "cpu_s": round(cpu, 2),
           "steps_per_cpu_s": round(steps / cpu, 1), "ms_per_step": round(1000 * cpu / steps, 2),
           "coordinator_state_ms_per_step": round(1000 * state_clock.seconds / steps, 2),
           "share_of_cpu_by_role": shares}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
