"""Options every role's command shares, checked the same way: an address msd cannot use is refused
at once, naming the option and the form it takes (msd_common.session.check_address), instead of a
ZeroMQ traceback or a peer waiting for a coordinator it never reaches; the log level is one of a
fixed list on every command."""

from __future__ import annotations

from typing import Any

import click

from .session import check_address, split_addresses


def coordinator_addresses(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """--coordinator: one address, or a primary's and its standbys', comma-separated."""
    if value is None:
        return value
    try:
        split_addresses(value)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


def bind_address(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """--bind: an address to bind (a host or port `*` allowed)."""
    try:
        return check_address(value, bind=True)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


LOG_LEVELS = click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False)
