"""`msd manifest` and `msd where`: what a step of a run held, and where a document went, recomputed
from the state dir's journals (coordinator/replay.py); no per-step storage, no running job."""

from __future__ import annotations

import sys

import click
import orjson


def _steps_range(text: str | None) -> tuple[int | None, int | None]:
    if not text:
        return None, None
    first, sep, last = text.partition(":")
    try:
        return (int(first) if first else None), (int(last) if sep and last else None)
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected A:B (steps A to B-1), A: or :B") from None


def _open(state_dir: str, config: str | None):
    from .config import ConfigError
    from .replay import ReplayError, job_of_state_dir, open_replay

    try:
        return open_replay(state_dir, job_of_state_dir(state_dir, config))
    except ConfigError as e:
        click.echo(f"{e.source}: invalid job file: " + "; ".join(e.problems), err=True)
    except (ReplayError, OSError) as e:
        click.echo(f"msd: {e}", err=True)
    sys.exit(1)


_CONFIG = click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
                       help="The job file (default: the one the state dir's coordinator recorded).")


@click.command()
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--step", required=True, type=click.IntRange(min=0))
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Only this data-parallel rank.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@click.option("--resolve", is_flag=True, help="Also name each piece's file and line, row or sample key.")
@_CONFIG
def manifest(state_dir: str, step: int, rank: int | None, as_json: bool, resolve: bool, config: str | None) -> None:
    """What step STEP held: per rank, micro-batch and sequence, each piece's source, doc_key,
    offset and length. Planned again from the journal, exactly as the job planned it."""
    from .replay import ReplayError, manifest_of

    replay = _open(state_dir, config)
    if step > replay.last_step:
        click.echo(f"msd manifest: step {step} was not planned (the journal ends at step {replay.last_step})",
                   err=True)
        sys.exit(1)
    try:
        plan = next(replay.plan_from(step))
    except ReplayError as e:
        click.echo(f"msd manifest: {e}", err=True)
        sys.exit(1)
    if rank is not None and rank >= replay.job.dp:
        click.echo(f"msd manifest: rank {rank} is not below dp={replay.job.dp}", err=True)
        sys.exit(2)
    out = manifest_of(plan, replay.job, replay.known, rank, resolve)
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(out, option=orjson.OPT_INDENT_2) + b"\n")
        return
    click.echo(f"step {step}: dp={out['dp']}, tokens per source "
               + ", ".join(f"{k}={v}" for k, v in out["source_tokens"].items()))
    for r, pieces in out["ranks"].items():
        click.echo(f"rank {r} (cost {out['rank_costs'][int(r)]:.4g}):")
        for p in pieces:
            where = f"  {p['where']}" if resolve else ""
            click.echo(f"  mb {p['micro_batch']} seq {p['sequence']}: {p['source']} doc_key {p['doc_key']} "
                       f"[{p['offset']}:+{p['length']}]{where}")


@click.command()
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, exists=True))
@click.option("--steps", "steps", default=None, help="A:B, steps A to B-1 (default: every journaled step).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_CONFIG
@click.argument("doc_key", type=int)
def where(state_dir: str, steps: str | None, as_json: bool, config: str | None, doc_key: int) -> None:
    """The steps, ranks and offsets at which document DOC_KEY was delivered."""
    from trainer_client.doc_keys import split_doc_key

    from .plan import LENGTH, OFFSET, RECORD, SOURCE
    from .replay import ReplayError

    first, last = _steps_range(steps)
    replay = _open(state_dir, config)
    source, record = split_doc_key(doc_key)
    if source >= len(replay.job.sources):
        click.echo(f"msd where: doc_key {doc_key} names source {source}; the job has {len(replay.job.sources)}",
                   err=True)
        sys.exit(2)
    first = min(replay.journaled) if first is None and replay.journaled else (first or 0)
    last = replay.last_step + 1 if last is None else min(last, replay.last_step + 1)
    found = []
    try:
        if first < last:
            for plan in replay.plan_from(first):
                hit = (plan.pieces[:, SOURCE] == source) & (plan.pieces[:, RECORD] == record)
                for i in hit.nonzero()[0].tolist():
                    found.append({"step": plan.step, "rank": int(plan.rank[i]),
                                  "micro_batch": int(plan.micro_batch[i]), "offset": int(plan.pieces[i, OFFSET]),
                                  "length": int(plan.pieces[i, LENGTH])})
                if plan.step + 1 >= last:
                    break
    except ReplayError as e:
        click.echo(f"msd where: {e}", err=True)
        sys.exit(1)
    name = replay.job.sources[source].name
    if as_json:
        sys.stdout.buffer.write(orjson.dumps({"doc_key": doc_key, "source": name, "record": record,
                                              "where": replay.known.reader(source).where(record),
                                              "steps": [first, last], "deliveries": found},
                                             option=orjson.OPT_INDENT_2) + b"\n")
        return
    click.echo(f"doc_key {doc_key}: source {name}, record {record} ({replay.known.reader(source).where(record)}); "
               f"steps {first}..{last - 1}: {len(found)} piece(s)")
    for f in found:
        click.echo(f"  step {f['step']} rank {f['rank']} mb {f['micro_batch']}: [{f['offset']}:+{f['length']}]")
