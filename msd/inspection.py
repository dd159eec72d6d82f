"""Questions about a job without a running job: `msd manifest` (what a step held) and `msd where`
(where a document went), recomputed from the state dir's journals, with no per-step storage; and
`msd plan` (a dry run of the planner over the job's data), and `msd report` (a run in one file). All
are built on msd/replay.py."""

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
    from msd_common.spec import ConfigError
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
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The coordinator's --state-dir (its journals and the job file it was started with).")
@click.option("--step", required=True, type=click.IntRange(min=0), help="The step to list.")
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
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The coordinator's --state-dir (its journals and the job file it was started with).")
@click.option("--steps", "steps", default=None, help="A:B, steps A to B-1 (default: every journaled step).")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_CONFIG
@click.argument("doc_key", type=int)
def where(state_dir: str, steps: str | None, as_json: bool, config: str | None, doc_key: int) -> None:
    """The steps, ranks and offsets at which document DOC_KEY was delivered."""
    from msd_common.doc_keys import split_doc_key

    from coordinator.plan import LENGTH, OFFSET, RECORD, SOURCE
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


@click.command("plan")
@click.argument("job_file", type=click.Path(dir_okay=False, exists=True))
@click.option("--steps", default=100, show_default=True, type=click.IntRange(min=1),
              help="Steps to plan (from the start, and from the start of every curriculum stage).")
@click.option("--dp", type=click.IntRange(min=1), default=None, help="What if: this data-parallel size "
              "(the same sequences per rank).")
@click.option("--seq-len", type=click.IntRange(min=1), default=None, help="What if: this sequence length.")
@click.option("--measure", is_flag=True, help="Measure each source's reading cost on a sample of records and "
              "say how many worker processes keep the ranks fed at --step-time.")
@click.option("--step-time", "step_time_s", type=float, default=1.0, show_default=True,
              help="Seconds per training step, for --measure.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (the summary per stage; --series adds each step).")
@click.option("--series", is_flag=True, help="With --json: every planned step too.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              help="Write a PNG of mix and balance over the planned steps (matplotlib).")
@click.option("--cost-from", "cost_from", type=click.Path(file_okay=False, exists=True), default=None,
              help="Plan with the cost model a finished run calibrated (balance.calibrate): the last one in "
                   "this state dir's cost journal.")
def plan_command(job_file: str, steps: int, dp: int | None, seq_len: int | None, measure: bool,
                 step_time_s: float, as_json: bool, series: bool, plot_path: str | None,
                 cost_from: str | None) -> None:
    """Dry-run the job's planner over its real data (no workers, no sockets): per stage the mix,
    tokens and pieces per step, padding, max/mean rank cost under msd's layout and under
    arrival-order dealing of the same documents, and the step-time gain the cost model predicts."""
    from . import dryrun
    from .commands import _fail_config
    from msd_common.spec import ConfigError, load_job

    try:
        job = dryrun.what_if(load_job(job_file), dp, seq_len)
        if cost_from is not None:
            job = dryrun.with_calibrated_cost(job, cost_from)
        report = dryrun.dry_run(job, steps)
    except ConfigError as e:
        _fail_config(e)
    except ValueError as e:
        click.echo(f"msd plan: {e}", err=True)
        sys.exit(2)
    known = report.pop("_known")
    if measure:
        report["workers"] = dryrun.workers_needed(report, dryrun.measure(job, known), step_time_s)
    if plot_path:
        dryrun.plot(report, plot_path)
    if not series:
        report.pop("series")
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(report, option=orjson.OPT_INDENT_2) + b"\n")
        return
    click.echo(f"{job_file}: dp={report['dp']}, seq_len={report['seq_len']}, {steps} step(s) per stage")
    for st in report["stages"]:
        if not st.get("steps"):
            click.echo(f"stage {st['stage']} (from step {st['first_step']}): nothing planned ({st.get('end')})")
            continue
        click.echo(f"stage {st['stage']} (from step {st['first_step']}, {st['steps']} steps planned):")
        click.echo("  mix (target -> realised): " + ", ".join(
            f"{n} {m['target']:.3f}->{m['realised']:.3f}" for n, m in st["mix"].items()))
        click.echo(f"  per step: {st['tokens_per_step']:.0f} tokens in {st['pieces_per_step']:.1f} pieces, "
                   f"padding {100 * st['padding_share']:.1f}%")
        click.echo(f"  max/mean rank cost: {st['max_over_mean']:.3f} (arrival order: {st['naive_max_over_mean']:.3f}); "
                   f"predicted step-time gain {st['predicted_step_time_gain']:.2f}x")
        if st.get("end"):
            click.echo(f"  the stream ends: {st['end']}")
    if measure:
        w = report["workers"]
        click.echo("reading cost: " + ", ".join(f"{n} {1e6 * s:.2f} us/token" for n,
                                                s in w["seconds_per_token"].items()))
        for st in w["stages"]:
            click.echo(f"stage {st['stage']}: {st['worker_seconds_per_step']:.3f} worker-seconds per step -> "
                       f"{st['worker_processes']} worker process(es) at {step_time_s:g} s per step")
    for name, e in report.get("eval", {}).items():
        click.echo(f"eval set {name}: {e['records']} records "
                   f"({', '.join(f'{k} {v}' for k, v in e['by_source'].items())}), "
                   f"{e['tokens']} tokens, {e['micro_batches_per_rank']} micro-batch(es) per rank, max/mean rank cost "
                   f"{e['max_over_mean']:.3f}")
    if report["skipped_records"]:
        click.echo("records that would be skipped: " + ", ".join(f"{n} {k}" for n, k in
                                                                 report["skipped_records"].items()))
    if plot_path:
        click.echo(f"plot: {plot_path}")


def _report_path(out: str) -> str:
    """--out names what it writes by its suffix: .html (or .htm) or .png; anything else is refused
    (report.pdf got HTML before, silently)."""
    if not out.lower().endswith((".html", ".htm", ".png")):
        raise click.BadParameter(f"{out}: msd report writes HTML (name it .html) or a PNG of the plots (.png)")
    return out


@click.command()
@click.option("--state-dir", required=True, type=click.Path(file_okay=False, exists=True),
              help="The coordinator's --state-dir (its journals and the job file it was started with).")
@click.option("--out", required=True, type=click.Path(dir_okay=False), callback=lambda ctx, p, v: _report_path(v),
              help="report.html (plots embedded, tables) or report.png (the plots).")
@click.option("--max-steps", default=200, show_default=True, type=click.IntRange(min=1),
              help="Steps whose balance is planned again, spread over the run.")
@_CONFIG
def report(state_dir: str, out: str, max_steps: int, config: str | None) -> None:
    """A report of a run from its state dir: realised mix against the target over the steps, balance
    per step against arrival-order dealing, data wait per rank, skipped and quarantined records."""
    from .report import gather, write_report

    replay = _open(state_dir, config)
    if len(replay.journaled) < 2:
        click.echo(f"msd report: {state_dir}: the journal holds fewer than two steps; nothing to report", err=True)
        sys.exit(1)
    write_report(gather(replay, state_dir, max_steps), out)
    click.echo(out)
