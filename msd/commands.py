"""The `msd` commands of the coordinator's side: coordinator, validate, mix, keys, demo
(`msd/cli.py` dispatches to them; `msd worker` lives in `worker/cli.py`)."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable

import click
import numpy as np

from msd_common.cli_params import LOG_LEVELS, bind_address, coordinator_addresses
from msd_common.logs import setup_logging

if TYPE_CHECKING:
    from msd_common.spec import ConfigError, JobConfig
    from coordinator.sources import OpenedSources

# The job-file machinery (numpy, the planner) is imported by the commands that read a job.


def _load_and_open(path: str, meanwhile: Callable[[], object] | None = None) -> tuple[JobConfig, OpenedSources]:
    """The job and its sources, opened as its coordinator opens them: the sources this host has
    no index of are left to the workers when the job says so (runtime.index_on: workers).
    meanwhile: work done while this host's indexing pool runs, if it does."""
    from msd_common.spec import load_job
    from coordinator.sources import open_as_coordinator

    job = load_job(path)
    return job, open_as_coordinator(job, meanwhile)


def _import_the_coordinator() -> None:
    """The coordinator proper's modules (~60 ms): imported while a cold start's pool indexes,
    rather than after it, while the cores wait."""
    import coordinator.app  # noqa: F401


def _fail_config(e: ConfigError) -> None:
    click.echo(f"{e.source}: invalid job file, {len(e.problems)} problem(s):", err=True)
    for p in e.problems:
        click.echo(f"  {p}", err=True)
    sys.exit(1)


@click.command()
@click.option("--coordinator", "address", required=True, callback=coordinator_addresses,
              help="The coordinator's control address (or a primary's and its standbys', comma-separated).")
@click.option("--at-step", type=int, required=True, help="First step planned with the new weights.")
@click.option("--timeout-s", type=float, default=10.0, show_default=True,
              help="Seconds to wait for the coordinator's answer.")
@click.option("--keys", "keys_dir", type=click.Path(file_okay=False), default=None,
              help="The job's key directory (a job with security.curve): changes are taken only from its "
                   "operator key (operator.key_secret).")
@click.argument("weights", nargs=-1, required=True)
def mix(address: str, at_step: int, timeout_s: float, keys_dir: str | None, weights: tuple[str, ...]) -> None:
    """Set new mixture weights (SOURCE=WEIGHT ...) from step AT_STEP on. The step must lie beyond
    what is already planned; the coordinator journals the change in its --state-dir, so a
    restarted coordinator plans the same stream."""
    from coordinator.mix import parse_weights, request_mix

    try:
        parsed = parse_weights(weights)
    except ValueError as e:
        click.echo(f"msd mix: {e}", err=True)
        sys.exit(2)
    try:
        ok, reason = request_mix(address, at_step, parsed, timeout_s, keys_dir)
    except FileNotFoundError as e:
        click.echo(f"msd mix: {e}", err=True)
        sys.exit(2)
    if not ok:
        click.echo(f"msd mix: refused: {reason}", err=True)
        sys.exit(1)
    click.echo(f"weights {parsed} apply from step {at_step}")


@click.command()
@click.option("--config", "config_path", required=True, type=click.Path(dir_okay=False), help="Job file (YAML).")
@click.option("--bind", default="tcp://127.0.0.1:5555", show_default=True, callback=bind_address,
              help="Address of the control socket.")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Directory for the coordinator's state (created if missing): the step journal, the "
                   "mixture journal, the job it was written for. A restart on it continues the same stream.")
@click.option("--allow-config-change", is_flag=True, default=False,
              help="Continue from --state-dir although the job file changed (beyond its topology).")
@click.option("--standby", is_flag=True, default=False,
              help="Wait until the coordinator holding --state-dir's lease is gone (it stops renewing it for 3 "
                   "heartbeats), then take over from its journal. Workers and clients given both addresses "
                   "(--coordinator tcp://a:5555,tcp://b:5555) move to it.")
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on this port (/metrics).")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Interface the metrics server binds.")
@click.option("--worker-procs", default=None, metavar="N|auto",
              help="Also run this machine's worker host in the coordinator's process, with N worker processes or "
                   "'auto' (the coordinator sets 1..--max-worker-procs by demand), as `msd worker --procs` would: "
                   "for a job on one machine, one command and one Python process fewer. Other hosts may still "
                   "join with msd worker.")
@click.option("--max-worker-procs", default=None, type=click.IntRange(min=1),
              help="With --worker-procs auto: the most worker processes here (default: the CPU count).")
@click.option("--log-level", default="INFO", show_default=True, type=LOG_LEVELS,
              help="Log lines of this level and above.")
def coordinator(config_path: str, bind: str, state_dir: str | None, allow_config_change: bool, standby: bool,
                metrics_port: int | None, metrics_host: str, worker_procs: str | None, max_worker_procs: int | None,
                log_level: str) -> None:
    """Run the job's coordinator."""
    from msd_common.spec import ConfigError

    procs = _worker_procs(worker_procs, max_worker_procs, standby, bind)
    setup_logging(log_level, "coordinator")
    host = None
    if procs is not None:
        from worker.host import InProcessHost

        # first, before a file or socket is open: the fork server is forked from this process now
        host = InProcessHost(None if procs == "auto" else procs, max_worker_procs, log_level.upper())
    try:
        try:
            job, sources = _load_and_open(config_path, meanwhile=_import_the_coordinator)
        except ConfigError as e:
            _fail_config(e)
        from coordinator.serving import serve
        from coordinator.statedir import JobChanged

        if host is not None:
            from worker.host import local_address

            host.start(local_address(bind), job.curve_keys)
        try:
            serve(job, sources, bind, state_dir, allow_config_change, standby, metrics_port, metrics_host)
        except JobChanged as e:
            click.echo(str(e), err=True)
            sys.exit(1)
        except ConfigError as e:  # a source the workers could not open (runtime.index_on: workers)
            _fail_config(e)
        finally:
            from msd_common.formats.indexing import wait_for_syncs

            wait_for_syncs(timeout_s=60)  # decompressed copies written at start-up reach the disk
    finally:
        if host is not None:
            host.close()


def _worker_procs(value: str | None, max_procs: int | None, standby: bool, bind: str) -> int | str | None:
    """--worker-procs as a count, "auto", or None (no worker host in this process)."""
    if value is None:
        if max_procs is not None:
            raise click.BadParameter("only with --worker-procs auto", param_hint="--max-worker-procs")
        return None
    if value != "auto" and not (value.isdigit() and int(value) >= 1):
        raise click.BadParameter(f"expected a number >= 1 or 'auto', got {value!r}", param_hint="--worker-procs")
    if max_procs is not None and value != "auto":
        raise click.BadParameter("only with --worker-procs auto", param_hint="--max-worker-procs")
    if bind.rsplit(":", 1)[-1] in ("0", "*"):
        raise click.BadParameter(f"{bind}: --worker-procs needs a fixed port here, for this host's agent to reach",
                                 param_hint="--bind")
    if standby:
        raise click.BadParameter("a standby runs no workers of its own (its primary's would stop with it): start "
                                 "them with msd worker --coordinator PRIMARY,STANDBY", param_hint="--worker-procs")
    return value if value == "auto" else int(value)


@click.group()
def keys() -> None:
    """CURVE keys for an encrypted, authenticated job (security.curve in the job file)."""


@keys.command("generate")
@click.argument("directory", type=click.Path(file_okay=False))
def keys_generate(directory: str) -> None:
    """Write key pairs for the coordinator, workers, trainers and operators (the key of msd mix and
    msd status) into DIRECTORY, and the public keys the coordinator and trainers accept into
    DIRECTORY/authorized/. In a directory of older keys, adds the missing operator pair."""
    from msd_common.security import generate

    try:
        written = generate(directory)
    except FileExistsError as e:
        click.echo(f"msd keys generate: {e}", err=True)
        sys.exit(1)
    for path in written:
        click.echo(path)
    click.echo("Secret keys (*.key_secret): give each host only its role's. Set security.curve: "
               f"{directory} in the job file; start workers with --keys and clients with keys_dir=; "
               "give msd mix and msd status --keys (the operator key: only it may change the plan).")


@click.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
def validate(job_file: str) -> None:
    """Check a job file and its sources (remote objects: that each exists and can be read); print a
    one-line summary or every problem (notes on the job, if any, go to stderr)."""
    from msd_common.formats.storage import is_url

    from msd_common.spec import ConfigError, load_job
    from coordinator.sources import check_readable, open_as_coordinator

    try:
        job = load_job(job_file)
        check_readable(job)  # every remote object, by URL, before the slower opening of each source
        # as the coordinator opens them: with index_on: workers, a corpus this host has not
        # indexed is not indexed here either (it may be terabytes)
        opened = open_as_coordinator(job)
    except ConfigError as e:
        _fail_config(e)
    counts = [("?" if i in opened.pending else n) for i, n in enumerate(opened.num_records)]
    sources = ", ".join(
        f"{s.name}={s.format}:{len(s.files)} file(s)/{n} records/w={job.weights[s.name]:.3f}"
        for s, n in zip(job.sources, counts)
    )
    click.echo(
        f"{job_file}: OK: {len(job.sources)} source{'' if len(job.sources) == 1 else 's'} ({sources}); step = "
        f"{job.batch.global_batch_size} x "
        f"{job.batch.seq_len} tokens over dp={job.dp}; seed {job.seed}; digest {job.digest()}"
    )
    if job.eval_sets and not opened.pending:
        from coordinator.evaluation import set_records
        from coordinator.holdout import Holdout

        holdout = Holdout(job.seed, list(opened.num_records), [dict(e.holdout) for e in job.eval_sets])
        for cfg in job.eval_sets:
            sources, _ = set_records(job, holdout, list(opened.num_records), cfg)
            parts = ", ".join(f"{job.sources[s].name} {int((sources == s).sum())}" for s in np.unique(sources).tolist())
            click.echo(f"eval set {cfg.name}: {len(sources)} records ({parts or 'none'})")
    for i, shards in sorted(opened.pending.items()):
        click.echo(f"note: sources.{job.sources[i].name}: {len(shards)} shard(s) not indexed on this host; the "
                   "workers index them and count its records at start-up (runtime.index_on: workers)", err=True)
    for s in job.sources:
        if s.shuffle_block == 1 and s.format != "arrow" and any(is_url(f) for f in s.files):
            click.echo(f"note: sources.{s.name} is read from object storage with a record-level shuffle, one request "
                       "per record; shuffle_block: 64 reads runs of neighbouring records in one request each "
                       "(docs/tutorials/bucket.md)", err=True)


@click.command()
@click.option("--steps", default=50, show_default=True, type=click.IntRange(min=1), help="Steps to train.")
@click.option("--ranks", default=2, show_default=True, type=click.IntRange(min=1),
              help="Trainer ranks (processes), data-parallel.")
@click.option("--workers", default=2, show_default=True, type=click.IntRange(min=1),
              help="Worker processes.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the summary here.")
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where the demo dataset is generated (default: the megascale-data cache dir).")
def demo(steps: int, ranks: int, workers: int, json_path: str | None, data_dir: str | None) -> None:
    """Run the embedded demo job end to end on loopback and summarise it."""
    from .testing.demo import run_demo

    sys.exit(run_demo(steps=steps, ranks=ranks, workers=workers, json_path=json_path, data_dir=data_dir))

