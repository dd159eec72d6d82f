"""The `msd` command line: only dispatches. Each command lives with its part and is imported when
it is run, so `msd worker` on a CPU host loads the worker's code and none of the coordinator's."""

from __future__ import annotations

import importlib
import os

import click

from msd_common.logs import FORMAT_ENV

COMMANDS = {
    "coordinator": "msd.commands:coordinator",
    "validate": "msd.commands:validate",
    "mix": "msd.commands:mix",
    "keys": "msd.commands:keys",
    "demo": "msd.commands:demo",
    "manifest": "msd.inspection:manifest",
    "where": "msd.inspection:where",
    "plan": "msd.inspection:plan_command",
    "status": "coordinator.status_view:status",
    "report": "msd.inspection:report",
    "relay": "relay.cli:relay",
    "worker": "worker.cli:worker",
}


def _log_format(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value:  # inherited by every process the command starts (worker processes, fork servers)
        os.environ[FORMAT_ENV] = value


def _with_log_format(cmd: click.Command) -> click.Command:
    """Every command takes --log-format (added here, once, rather than declared by each)."""
    if not any(p.name == "log_format" for p in cmd.params):
        cmd.params.append(click.Option(["--log-format"], type=click.Choice(["text", "json"]), default=None,
                                       expose_value=False, is_eager=True, callback=_log_format,
                                       help="Log lines as text (default) or one JSON object per line."))
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _with_log_format(sub)
    return cmd


class _Dispatch(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return _with_log_format(getattr(importlib.import_module(module), attr))


@click.group(cls=_Dispatch)
@click.option("--log-format", type=click.Choice(["text", "json"]), default=None, expose_value=False,
              is_eager=True, callback=_log_format, help="Log lines as text (default) or one JSON object per line.")
def main() -> None:
    """megascale-data: one coordinator plans every global batch; stateless workers read and
    transform samples once and push them straight to the trainer ranks."""


if __name__ == "__main__":
    main()
