"""`python -m msd.sim --seeds N [--first-seed S] [--steps K] [--json OUT]`: run N seeds of the
deterministic simulation; exit 0 only when every seed held. A failing seed prints its trace up to
the violation and the command that replays it."""

from __future__ import annotations

import gc
import json
import os
import sys
import time

import click

from .run import run_seed


@click.command()
@click.option("--seeds", type=click.IntRange(min=1), default=20, show_default=True, help="How many seeds to run.")
@click.option("--first-seed", type=int, default=None,
              help="The first seed (default: a fresh random one, printed; seeds run consecutively).")
@click.option("--steps", type=click.IntRange(min=1), default=40, show_default=True, help="Steps each seed trains.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write the results here: {\"seeds\": [{seed, steps, faults, digest, ok}], ...}.")
@click.option("--trace", is_flag=True, help="Print every seed's trace (replaying one seed).")
def main(seeds: int, first_seed: int | None, steps: int, json_out: str | None, trace: bool) -> None:
    """Run whole msd jobs (coordinator, workers, ranks) in one process under simulated time and a
    simulated network, with faults drawn from each seed, and check that every rank gets exactly
    the fault-free stream and that no step stalls."""
    if first_seed is None:
        first_seed = int.from_bytes(os.urandom(4), "little")
    click.echo(f"msd.sim: seeds {first_seed}..{first_seed + seeds - 1}, {steps} steps each", err=True)
    results = []
    cpu = time.process_time()
    trained = 0
    for seed in range(first_seed, first_seed + seeds):
        result, lines = run_seed(seed, steps, trace=trace)
        gc.collect()  # each seed's processes hold files and maps in cycles: closed before the next seed
        results.append(result)
        trained += result["steps"]
        if trace:
            click.echo("\n".join(lines))
        if not result["ok"]:
            click.echo(f"\nseed {seed} FAILED: {result['error']}", err=True)
            click.echo("trace up to the violation (simulated seconds):", err=True)
            click.echo("\n".join(lines[-60:]), err=True)
            click.echo(f"replay: python -m msd.sim --seeds 1 --first-seed {seed} --steps {steps} --trace\n", err=True)
    cpu = time.process_time() - cpu
    failed = [r["seed"] for r in results if not r["ok"]]
    summary = {"seeds": results, "first_seed": first_seed, "steps": steps, "failed": failed,
               "cpu_s": round(cpu, 2), "steps_per_cpu_s": round(2 * trained / cpu, 1) if cpu else None}
    click.echo(f"msd.sim: {len(results) - len(failed)}/{len(results)} seeds held; {cpu:.1f} CPU s, "
               f"{summary['steps_per_cpu_s']} simulated steps per CPU second (fault-free and faulty runs)"
               + (f"; failed: {failed}" if failed else ""), err=True)
    if json_out:
        with open(json_out, "w") as f:
            json.dump(summary, f, indent=1)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
