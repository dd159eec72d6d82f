"""`msd worker`: the worker host agent's command (dispatched by msd/cli.py)."""

from __future__ import annotations

import sys

import click

from msd_common.cli_params import LOG_LEVELS, coordinator_addresses


@click.command()
@click.option("--coordinator", "address", required=True, callback=coordinator_addresses,
              help="Coordinator address, e.g. tcp://HEAD:5555; a primary and its standbys comma-separated.")
@click.option("--procs", default="1", show_default=True,
              help="Worker processes: a number, or 'auto' (the coordinator sets 1..--max-procs by demand).")
@click.option("--max-procs", default=None, type=click.IntRange(min=1),
              help="With --procs auto: the most processes on this host (default: its CPU count).")
@click.option("--keys", "keys_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="Key directory (msd keys generate) when the job sets security.curve.")
@click.option("--metrics-port", type=int, default=None,
              help="Serve the worker processes' Prometheus metrics on this port (/metrics), one target per host.")
@click.option("--metrics-host", default="127.0.0.1", show_default=True, help="Interface the metrics server binds.")
@click.option("--log-level", default="INFO", show_default=True, type=LOG_LEVELS,
              help="Log lines of this level and above.")
def worker(address: str, procs: str, max_procs: int | None, keys_dir: str | None, metrics_port: int | None,
           metrics_host: str, log_level: str) -> None:
    """Run a worker host agent with N worker processes (or a number the coordinator sets)."""
    if procs != "auto" and not (procs.isdigit() and int(procs) >= 1):
        raise click.BadParameter(f"expected a number >= 1 or 'auto', got {procs!r}", param_hint="--procs")
    if max_procs is not None and procs != "auto":
        raise click.BadParameter("only with --procs auto", param_hint="--max-procs")
    from msd_common.logs import setup_logging

    setup_logging(log_level, "worker-host")
    from .host import HostAgent

    agent = HostAgent(address, None if procs == "auto" else int(procs), log_level.upper(), keys_dir=keys_dir,
                      max_procs=max_procs, metrics_port=metrics_port, metrics_host=metrics_host)
    sys.exit(agent.run())
