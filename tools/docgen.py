"""The documentation's generated reference pages, from the code itself, so they cannot drift.

Used two ways: as an MkDocs hook (mkdocs.yml `hooks:`), which replaces a marker such as
`<!-- generated: job-keys -->` in a page by the table it names; and by tests/docs, which check
that every key, flag and metric has an entry with a meaning.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterator

import click

MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")


def _name(text: str, breaks: str = ".") -> str:
    """A name a reader looks for (a key, a flag, a metric, a message): code that a narrow column may
    break only after one of `breaks` (a job-file key at its dots; a metric's long name also at its
    underscores), never inside a word nor at a flag's hyphens (docs/stylesheets/extra.css)."""
    import html

    parts = re.split(f"(?<=[{re.escape(breaks)}])", text)
    return '<code class="msd-name">' + "<wbr>".join(f"<span>{html.escape(p)}</span>" for p in parts) + "</code>"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# ---------------------------------------------------------------- job file


def job_keys_md() -> str:
    from msd_common.job_keys import KEYS

    sections: dict[str, list[Any]] = {}
    for key in KEYS:
        top = key.path.split(".")[0].split("[")[0]
        sections.setdefault(top if "." in key.path or "[" in key.path else "(top level)", []).append(key)
    out = []
    for title, keys in sections.items():
        out += [f"### `{title}`" if title != "(top level)" else "### Top level", "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        out += [f"| {_name(k.path)} | {_cell(k.type)} | {_cell(k.default)} | {_cell(k.meaning)} |" for k in keys]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------- command line


def commands() -> Iterator[tuple[str, click.Command]]:
    """(full name, command) of `msd` and every command and subcommand under it."""
    from msd.cli import main

    ctx = click.Context(main, info_name="msd")

    def walk(name: str, cmd: click.Command, ctx: click.Context) -> Iterator[tuple[str, click.Command]]:
        yield name, cmd
        if isinstance(cmd, click.Group):
            for sub in cmd.list_commands(ctx):
                child = cmd.get_command(ctx, sub)
                if child is not None:
                    yield from walk(f"{name} {sub}", child, click.Context(child, info_name=sub, parent=ctx))

    yield from walk("msd", main, ctx)


def options(cmd: click.Command) -> list[click.Parameter]:
    return [p for p in cmd.params if isinstance(p, click.Option) or isinstance(p, click.Argument)]


def cli_md() -> str:
    out = []
    for name, cmd in commands():
        ctx = click.Context(cmd, info_name=name)
        out += [f"### `{name}`", "", (cmd.help or "").strip(), "", "```text",
                f"{name} {' '.join(cmd.collect_usage_pieces(ctx))}", "```", ""]
        rows = []
        for p in cmd.params:
            if isinstance(p, click.Option):
                flags = ", ".join(_name(o) for o in p.opts + p.secondary_opts)
                unset = p.default is None or type(p.default).__name__ == "Sentinel" or p.is_flag
                default = "" if unset or p.default in ((), "") else f"`{p.default}`"
                kind = "flag" if p.is_flag else _cell(p.make_metavar(ctx) if hasattr(p,
                                                                                     "make_metavar") else p.type.name)
                rows.append(f"| {flags} | {kind} | {default} | "
                            f"{_cell(p.help or '')}{' (required)' if p.required else ''} |")
            elif isinstance(p, click.Argument):
                rows.append(f"| {_name(p.human_readable_name)} | argument | | {_cell(getattr(p, 'doc', '') or '')} |")
        if rows:
            out += ["| option | value | default | meaning |", "|---|---|---|---|", *rows, ""]
    return "\n".join(out)


# ---------------------------------------------------------------- metrics


def metric_families() -> list[tuple[str, str, str, str, tuple[str, ...]]]:
    """(exposed name, type, help, process, labels) of every metric the coordinator and workers serve."""
    from prometheus_client import CollectorRegistry

    from coordinator.metrics import CoordinatorMetrics
    from worker.metrics import WorkerMetrics

    worker_registry = CollectorRegistry()
    WorkerMetrics(registry=worker_registry)
    found = []
    for process, registry in (("coordinator", CoordinatorMetrics().registry), ("worker", worker_registry)):
        # the label names of a metric with no samples yet are only on the metric object itself
        declared = {name: tuple(getattr(c, "_labelnames", ())) for c, names in registry._collector_to_names.items()
                    for name in names}
        for family in registry.collect():
            name = family.name + ("_total" if family.type == "counter" else "")
            labels = declared.get(family.name) or tuple(getattr(family, "_labelnames", ()) or ())
            found.append((name, family.type, family.documentation, process, labels))
    return found


def metrics_md() -> str:
    out = ["| metric | type | labels | served by | meaning |", "|---|---|---|---|---|"]
    for name, kind, doc, process, labels in metric_families():
        out.append(f"| {_name(name, breaks='_')} | {kind} | {', '.join(f'`{x}`' for x in labels)} | {process} | "
                   f"{_cell(doc)} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- wire protocol


def protocol_md() -> str:
    from msd_common import protocol as p

    inboxes = {"coordinator": p.COORDINATOR_INBOX, "worker": p.WORKER_INBOX, "worker host": p.HOST_INBOX,
               "trainer (control)": p.TRAINER_CONTROL_INBOX, "trainer (data)": p.TRAINER_DATA_INBOX,
               "msd mix / status": p.TOOL_INBOX}
    out = [f"Protocol version **{p.PROTOCOL_VERSION}**. Every message is a msgpack header (a map with `type` and "
           "the fields below) followed by raw array frames; anything else, or a type the receiving socket does not "
           "take, is dropped at decode.", "",
           "| message | received by | header fields | array frames |", "|---|---|---|---|"]
    for name, m in sorted(p.ALL_TYPES.items()):
        to = ", ".join(role for role, inbox in inboxes.items() if name in inbox)
        arrays = ", ".join(f"`{a.name}`" + (f" ({', '.join(a.columns._fields)})" if a.columns else "")
                           for a in m.arrays)
        if m.tail:
            arrays += f", then up to {m.tail} more frames (a processor's arrays, one per item and array)"
        out.append(f"| {_name(name)} | {to} | {', '.join(f'`{f}`' for f in m.fields)} | {arrays} |")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- batch schema


def batch_md() -> str:
    from trainer_client.batch import BATCH_KEYS

    out = ["| key | dtype | shape | present | meaning |", "|---|---|---|---|---|"]
    out += [f"| {_name(k.key)} | {k.dtype} | {_cell(k.shape)} | {k.present} | {_cell(k.meaning)} |" for k in BATCH_KEYS]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- msd validate, as it answers


VALIDATE_EXAMPLE = """seed: 1
sources:
  web: {format: jsnol, paths: ["data/*.jsonl"]}
batch: {seq_len: 512, micro_batch_size: 2, global_batch_size: 6}
topology: {dp: 2}
mixture: {weights: {web: 1.0}}
"""


def validate_md() -> str:
    """What `msd validate` answers for a job file with two mistakes, run now (so the page shows the
    command's own words)."""
    import os
    import tempfile

    from click.testing import CliRunner

    from msd.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "data"))
        with open(os.path.join(tmp, "data", "a.jsonl"), "w") as f:
            f.write('{"text": "hello"}\n')
        with open(os.path.join(tmp, "job.yaml"), "w") as f:
            f.write(VALIDATE_EXAMPLE)
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            result = CliRunner().invoke(main, ["validate", "job.yaml"])
        finally:
            os.chdir(cwd)
    return ("```yaml\n" + VALIDATE_EXAMPLE + "```\n\n```text\n$ msd validate job.yaml\n"
            + result.output.rstrip() + "\n```\n")


# ---------------------------------------------------------------- floors and modules


def floors_md() -> str:
    import os
    import sys

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import floors

    return floors.floors_md()


GENERATORS: dict[str, Callable[[], str]] = {"job-keys": job_keys_md, "cli": cli_md, "metrics": metrics_md,
                                            "protocol": protocol_md, "batch": batch_md, "floors": floors_md,
                                            "validate": validate_md}


def expand(markdown: str) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)


# ---------------------------------------------------------------- MkDocs hook


def on_page_markdown(markdown: str, page: Any = None, config: Any = None, files: Any = None) -> str:
    return expand(markdown)
