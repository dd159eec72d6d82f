"""`msd relay`: one per trainer host, beside the trainer (relay/process.py)."""

from __future__ import annotations

import click

from msd_common.cli_params import LOG_LEVELS, coordinator_addresses


@click.command()
@click.option("--coordinator", "address", required=True, callback=coordinator_addresses,
              help="The coordinator's address (tcp://HEAD:5555), or a primary's and its standbys', comma-separated.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="The address workers reach this relay at (this host's address on their network).")
@click.option("--local", default=None,
              help="The endpoint this host's ranks reach the relay at (ipc://PATH). Default: one per job, from the "
                   "coordinator's address, which DataClient(relay='auto') and MSD_RELAY=auto find too.")
@click.option("--bind-host", default=None, help="The interface the workers' socket binds on, where it differs from "
                                               "--host (a container, a NAT): 0.0.0.0 for every interface.")
@click.option("--port", type=int, default=0, help="The port workers reach this relay at (default: a free one).")
@click.option("--keys", "keys_dir", default=None, type=click.Path(file_okay=False, exists=True),
              help="The job's key directory when it sets security.curve: the relay speaks with the trainer key.")
@click.option("--log-level", default="INFO", show_default=True, type=LOG_LEVELS,
              help="Log lines of this level and above.")
def relay(address: str, host: str, local: str | None, bind_host: str | None, port: int, keys_dir: str | None,
          log_level: str) -> None:
    """Serve this host's trainer ranks: one data connection from each worker process for all of
    them, and one voice to the coordinator. Start one per trainer host, before or after its ranks
    (a Slurm per-node step, a systemd unit, a Kubernetes sidecar); ranks use it with
    DataClient(..., relay=ENDPOINT) or MSD_RELAY=ENDPOINT."""
    from msd_common.logs import setup_logging

    setup_logging(log_level, "relay")
    from .process import serve

    serve(address, host=host, local=local, bind_host=bind_host, port=port, keys_dir=keys_dir)
