"""Every metric, command flag and job-file key a page names exists (issue 61: the vision-language
tutorial named `msd_records_skipped_total`, a metric msd never had; it is `msd_skipped_records_total`).

The pages are every Markdown file under docs/, README.md and the chart's values documentation;
what they name is read from inline code and code blocks:
- `msd_...` words that are not module names: each a metric family of the registry (or a prefix
  of some, written `msd_relay_`);
- `msd COMMAND ... --flag`: each flag one of that command's options;
- dotted job-file keys (`runtime.heartbeat_s`, `sources.web.tokenizer`, `eval.heldout.holdout`):
  each a key of the reference, a source's or eval set's own name standing for `<name>`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import click

from msd_common.job_keys import KEYS

from .runnable import REPO

sys.path.insert(0, str(REPO / "tools"))
import docgen  # noqa: E402

PAGES = sorted([*(REPO / "docs").rglob("*.md"), REPO / "README.md"])
CODE = re.compile(r"```[a-z]*\n(.*?)```|`([^`\n]+)`", re.S)
TOP = {k.path for k in KEYS if "." not in k.path and "[" not in k.path}
NAMED = {"sources", "eval"}  # their second segment is the user's own name


def _code(page: Path) -> list[tuple[int, str]]:
    """(line, text) of every inline code span and code block of the page."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1) or m.group(2)) for m in CODE.finditer(text)]


def _where(page: Path, line: int) -> str:
    return f"{page.relative_to(REPO)}:{line}"


def test_every_metric_a_page_names_exists() -> None:
    families = {f[0] for f in docgen.metric_families()}
    modules = {p.name for p in REPO.iterdir() if p.is_dir()}  # msd_common, ...
    wrong = []
    for page in PAGES:
        for line, code in _code(page):
            for name in re.findall(r"\bmsd_[a-z_]+\b", code):
                if name in modules or name in families or (name.endswith("_") and any(
                        f.startswith(name) for f in families)):
                    continue
                wrong.append(f"{_where(page, line)}: {name}")
    assert not wrong, "metrics no process exports:\n" + "\n".join(wrong)


def test_every_flag_a_page_gives_a_command_exists() -> None:
    commands = dict(docgen.commands())
    wrong = []
    for page in PAGES:
        for line, code in _code(page):
            for call in re.findall(r"(?:^|[\s;&|(`$])(msd(?: [a-z][a-z-]*)+(?: [^\n;&|#)]*)?)", code, re.M):
                words = call.split()
                name = "msd"
                for w in words[1:]:
                    if f"{name} {w}" not in commands:
                        break
                    name = f"{name} {w}"
                if name == "msd" or not isinstance(commands[name], click.Command):
                    continue
                opts = {o for p in commands[name].params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts",
                                                                                                   [])}
                for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", call):
                    if flag not in opts and flag != "--help":
                        wrong.append(f"{_where(page, line)}: `{name}` has no {flag}")
    assert not wrong, "flags the commands do not take:\n" + "\n".join(wrong)


def _key_exists(path: str) -> bool:
    parts = path.split(".")
    if parts[0] in NAMED and len(parts) > 2:
        parts[1] = "<name>"
    if parts[0] == "mixture" and len(parts) > 1 and parts[1] not in ("weights", "adapt"):
        parts[0] = "mixture[]"
    known = {k.path for k in KEYS}
    return any(".".join(parts[:n]) in known for n in range(len(parts), 0, -1)) and (
        ".".join(parts) in known or parts[-2:] == ["mixture", "weights"] or path.startswith("mixture.weights.")
        or ".".join(parts[:-1]) in {"sources.<name>.storage", "security.curve", "balance.cost"}
        or (parts[0] in NAMED and len(parts) == 2))


FILES = {"py", "json", "journal", "yaml", "md", "msgpack", "txt"}


def _python_name(path: str) -> bool:
    """`balance.whole_layout`, `topology.py`: a module's name or a file, not a job-file key."""
    import importlib

    first, rest = path.split(".", 1)
    if rest in FILES or rest.startswith("_"):
        return True
    for package in ("coordinator", "msd_common", "trainer_client", "worker"):
        try:
            module = importlib.import_module(f"{package}.{first}")
        except ImportError:
            continue
        if hasattr(module, rest.split(".")[0]):
            return True
    return False


def test_every_job_key_a_page_names_exists() -> None:
    wrong = []
    for page in PAGES:
        for line, code in _code(page):
            if "\n" in code:
                continue  # (blocks: YAML is checked by msd validate where a page runs it)
            for path in re.findall(r"^([a-z_]+(?:\.[a-z_<>\[\]]+)+)(?:[:=]|$)", code.strip()):
                if path.split(".")[0] not in TOP or "(" in code or _python_name(path):
                    continue
                if not _key_exists(path):
                    wrong.append(f"{_where(page, line)}: {path}")
    assert not wrong, "job-file keys the reference does not have:\n" + "\n".join(wrong)


def test_the_checks_catch_what_issue_61_found(tmp_path, monkeypatch) -> None:
    import pytest

    page = tmp_path / "page.md"
    page.write_text("Watch `msd_records_skipped_total`.\n\n```sh\nmsd status --coordinator tcp://a:1 --watch\n```\n\n"
                    "Set `runtime.heartbeat_secs: 2`.\n")
    monkeypatch.setattr(sys.modules[__name__], "PAGES", [page])
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    for check, found in ((test_every_metric_a_page_names_exists, "msd_records_skipped_total"),
                         (test_every_flag_a_page_gives_a_command_exists, "`msd status` has no --watch"),
                         (test_every_job_key_a_page_names_exists, "runtime.heartbeat_secs")):
        with pytest.raises(AssertionError, match=re.escape(found)):
            check()
