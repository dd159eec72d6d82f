"""The `msd` command line: only dispatches. Each command lives with its part and is imported when
it is run, so `msd worker` on a CPU host loads the worker's code and none of the coordinator's."""

from __future__ import annotations

import importlib

import click

COMMANDS = {
    "coordinator": "coordinator.commands:coordinator",
    "validate": "coordinator.commands:validate",
    "mix": "coordinator.commands:mix",
    "keys": "coordinator.commands:keys",
    "demo": "coordinator.commands:demo",
    "manifest": "coordinator.inspection:manifest",
    "where": "coordinator.inspection:where",
    "plan": "coordinator.inspection:plan_command",
    "status": "coordinator.status_view:status",
    "report": "coordinator.inspection:report",
    "worker": "worker.cli:worker",
}


class _Dispatch(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        return getattr(importlib.import_module(module), attr)


@click.group(cls=_Dispatch)
def main() -> None:
    """megascale-data: one coordinator plans every global batch; stateless workers read and
    transform samples once and push them straight to the trainer ranks."""


if __name__ == "__main__":
    main()
