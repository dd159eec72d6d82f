"""`msd status`: a running job as its coordinator sees it, as a live terminal view (rich) or one
JSON snapshot for scripts."""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import orjson

from msd_common import protocol as P
from msd_common.cli_params import coordinator_addresses


def fetch_status(address: str, keys_dir: str | None = None, timeout_s: float = 5.0) -> dict[str, Any]:
    """One status snapshot of the coordinator at `address` (raises control.NoAnswer)."""
    from .control import ask

    return ask(address, P.StatusRequest(), timeout_s, keys_dir).status


def status_line(status: dict[str, Any]) -> str:
    """One short log line of a status snapshot (the whole of it is status.json's and `msd status`'s):
    where the plan and the ranks are, the pace, the workers, and what is wrong."""
    consumed = status.get("consumed") or {}
    waits = status.get("data_wait_s") or {}
    workers = status.get("workers_by_host") or {}
    skipped = sum(n for kinds in (status.get("skipped_by_kind") or {}).values() for n in kinds.values())
    ranks = (f"slowest rank at step {min(consumed.values())} of {len(consumed)} rank(s)" if consumed else
             "no rank connected")
    line = (f"status: planned through step {status.get('next_step', 0) - 1}, {ranks}, "
            f"{status.get('steps_per_s', 0):.2f} steps/s, {sum(len(p) for p in workers.values())} worker(s) on "
            f"{len(workers)} host(s), longest data wait {max(waits.values(), default=0.0):.2f}s, "
            f"{skipped} record(s) skipped")
    relays = status.get("relays") or []
    if relays:
        line += (f", {len(relays)} relay(s) for {sum(len(r['ranks']) for r in relays)} rank(s), "
                 f"{sum(r['late_steps'] for r in relays)} late step(s)")
    if status.get("state_dir_stalled_s"):
        line += f"; STATE DIR STALLED {status['state_dir_stalled_s']:.0f}s"
    if status.get("failed"):
        line += f"; JOB FAILED: {status['failed']}"
    return line


def render(status: dict[str, Any]) -> Any:
    """The view of one snapshot: a rich renderable."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    consumed = status.get("consumed") or {}
    ranks = f"slowest rank at step {min(consumed.values())}" if consumed else "no rank connected"
    head = Text()
    head.append(f"{status.get('job')}  ", style="bold")
    head.append(f"digest {status.get('digest')}  dp={status.get('dp')}\n")
    head.append(f"planned through step {status.get('next_step', 0) - 1}, {ranks}, "
                f"{status.get('steps_per_s', 0):.2f} steps/s")
    if "journal_lag_steps" in status:
        head.append(f", journal lag {status['journal_lag_steps']} step(s)")
    counting = status.get("counting")
    if counting:  # runtime.index_on: workers, before the first plan
        head.append(f"\nwaiting for the workers to index {counting['shards_to_index']} shard(s): "
                    f"{counting['counted']} of {counting['sources']} source(s) counted, {counting['workers']} "
                    f"worker(s)", style="bold yellow")
    if status.get("failed"):
        head.append(f"\nJOB FAILED: {status['failed']}", style="bold red")
    elif status.get("stopped"):
        head.append(f"\nstopped: {status['stopped']}", style="bold")
    if status.get("state_dir_stalled_s"):
        head.append(f"  STATE DIR STALLED {status['state_dir_stalled_s']:.0f}s", style="bold red")

    ranks = Table(title="ranks", title_justify="left")
    for col in ("rank", "consumed", "data wait s"):
        ranks.add_column(col, justify="right")
    waits = status.get("data_wait_s") or {}
    for r in sorted(consumed, key=int):
        ranks.add_row(str(r), str(consumed[r]), f"{waits.get(r, 0.0):.2f}")

    sources = Table(title="sources", title_justify="left")
    for col, just in (("source", "left"), ("target now", "right"), ("target so far", "right"),
                      ("realised so far", "right"), ("skipped", "right")):
        sources.add_column(col, justify=just)
    skipped = status.get("skipped_by_kind") or {}
    for name, target in (status.get("target_share") or {}).items():
        kinds = skipped.get(name) or {}
        kinds = {**kinds, **((status.get("long_docs") or {}).get(name) or {})}  # truncated / dropped long docs
        so_far = (status.get("target_so_far_share") or {}).get(name)
        sources.add_row(name, f"{target:.3f}", "-" if so_far is None else f"{so_far:.3f}",
                        f"{(status.get('realised_share') or {}).get(name, 0.0):.3f}",
                        ", ".join(f"{k} {n}" for k, n in kinds.items()) or "0")

    workers = Table(title="workers", title_justify="left")
    for col, just in (("host", "left"), ("processes", "right"), ("busy share", "right")):
        workers.add_column(col, justify=just)
    for host, procs in sorted((status.get("workers_by_host") or {}).items()):
        shares = [p["busy_share"] for p in procs]
        workers.add_row(host, str(len(procs)), " ".join(f"{s:.2f}" for s in shares))

    parts = [head, ranks, sources, workers]
    relays = status.get("relays") or []
    if relays:  # one per trainer host that has one (`msd relay`)
        table = Table(title="relays", title_justify="left")
        for col, just in (("host", "left"), ("ranks", "left"), ("MB in", "right"), ("MB out", "right"),
                          ("queued", "right"), ("late steps", "right")):
            table.add_column(col, justify=just)
        for r in sorted(relays, key=lambda r: (r["host"], r["relay_id"])):
            table.add_row(f"{r['host']} ({r['address']})", _ranges(r["ranks"]), f"{r['bytes_in'] / 1e6:.1f}",
                          f"{r['bytes_out'] / 1e6:.1f}", str(r["queued"]), str(r["late_steps"]))
        parts.append(table)
    evals = status.get("eval") or {}
    if evals:
        table = Table(title="eval sets", title_justify="left")
        for col, just in (("set", "left"), ("records", "right"), ("pass", "right"), ("last loss by source", "left")):
            table.add_column(col, justify=just)
        for name, e in sorted(evals.items()):
            losses = ", ".join(f"{src} {v['loss']:.4f} (step {v['step']})" for src, v in sorted(e["loss"].items()))
            table.add_row(name, str(e["records"]), str(e["pass"]) if e["pass"] >= 0 else "-", losses or "-")
        parts.append(table)
    warnings = Text("\n".join(status.get("warnings") or ["(no warnings)"]), style="yellow")
    return Group(*parts, Text("last warnings:", style="bold"), warnings)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 3, 8] -> '0-3, 8'."""
    out: list[str] = []
    for r in sorted(ranks):
        if out and out[-1][1] == r - 1:
            out[-1] = (out[-1][0], r)
        else:
            out.append((r, r))
    return ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in out) or "-"


def last_status(state_dir: str) -> dict[str, Any] | None:
    """The status the job's coordinator last wrote to its state dir (status.json), if any."""
    from .statedir import STATUS_FILE

    try:
        with open(f"{state_dir}/{STATUS_FILE}", "rb") as f:
            return orjson.loads(f.read())
    except (OSError, ValueError):
        return None


def _stopped_since_started(state_dir: str) -> bool:
    """Whether the last status of the state dir's coordinator says it stopped, written after that
    coordinator started (a coordinator started since rewrites coordinator.json)."""
    import os

    from .statedir import STATE_FILE

    snapshot = last_status(state_dir)
    try:
        started = os.path.getmtime(os.path.join(state_dir, STATE_FILE))
    except OSError:
        return False
    return bool(snapshot and snapshot.get("stopped") and float(snapshot.get("time", 0)) >= started)


def _plain(renderable: Any) -> str:
    import io

    from rich.console import Console

    console = Console(width=120, file=io.StringIO())
    console.print(renderable)
    return console.file.getvalue()


@click.command()
@click.option("--coordinator", "address", default=None, callback=coordinator_addresses,
              help="The coordinator's control address (or a primary's and its standbys', comma-separated).")
@click.option("--state-dir", type=click.Path(file_okay=False), default=None,
              help="Find the coordinator's address in its state dir instead.")
@click.option("--keys", "keys_dir", type=click.Path(file_okay=False), default=None,
              help="The job's key directory (a job with security.curve): any authorised key may read status.")
@click.option("--json", "as_json", is_flag=True, help="Print one snapshot as JSON and exit.")
@click.option("--interval", type=float, default=1.0, show_default=True, help="Seconds between refreshes.")
@click.option("--timeout-s", type=float, default=5.0, show_default=True,
              help="Seconds to wait for the coordinator's answer (then status.json is read).")
def status(address: str | None, state_dir: str | None, keys_dir: str | None, as_json: bool, interval: float,
           timeout_s: float) -> None:
    """Show a running job: step, steps/s, data wait per rank, target and realised share per source,
    workers per host and their busy share, skipped records, journal lag, the last warnings."""
    from .control import NoAnswer

    if address is None:
        if state_dir is None:
            raise click.UsageError("give --coordinator ADDR or --state-dir DIR")
        from .statedir import STATE_FILE, read_state_file

        try:
            address = read_state_file(state_dir)["address"]
        except (OSError, ValueError, KeyError) as e:
            click.echo(f"msd status: {state_dir}/{STATE_FILE}: no coordinator address ({e})", err=True)
            sys.exit(1)
        if _stopped_since_started(state_dir):  # nobody to ask: the last status at once, not after timeout_s
            timeout_s = 0.0
    try:
        if timeout_s <= 0:
            raise NoAnswer("the job's coordinator stopped (its last status says so)")
        snapshot = fetch_status(address, keys_dir, timeout_s)
    except (NoAnswer, FileNotFoundError) as e:
        snapshot = last_status(state_dir) if state_dir else None
        if snapshot is None:
            click.echo(f"msd status: {e}", err=True)
            sys.exit(1)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snapshot.get("time", 0)))
        click.echo(f"msd status: no coordinator answers at {address}; the last status it wrote ({state_dir}, "
                   f"{when}):", err=True)
        if as_json:
            sys.stdout.buffer.write(orjson.dumps(snapshot, option=orjson.OPT_INDENT_2) + b"\n")
        else:  # the job is not running: one view, not a live one
            click.echo(_plain(render(snapshot)))
        sys.exit(1 if snapshot.get("failed") else 0)
    if as_json:
        sys.stdout.buffer.write(orjson.dumps(snapshot, option=orjson.OPT_INDENT_2 | orjson.OPT_NON_STR_KEYS)
                                + b"\n")
        return
    if not sys.stdout.isatty():  # a file or a pipe (a script): one view, not a live one that never ends
        click.echo(_plain(render(snapshot)))
        sys.exit(1 if snapshot.get("failed") else 0)
    from rich.live import Live

    with Live(render(snapshot), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                time.sleep(interval)
                try:
                    live.update(render(fetch_status(address, keys_dir, timeout_s)))
                except NoAnswer as e:
                    live.update(f"[red]{e}[/red]")
        except KeyboardInterrupt:
            pass
