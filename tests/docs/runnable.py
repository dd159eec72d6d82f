"""The runnable blocks of the documentation: fenced `sh` and `python` blocks right after a
`<!-- runnable -->` line. A page's blocks run in order, in one fresh directory, as a reader would
type them: shell blocks with bash (`set -e`), Python blocks with the interpreter running the tests,
with a copy of the repository's `configs/` as `./configs` (a reader works in a checkout; a copy, so
that the indexes msd writes beside data stay out of the repository), and its `tools/` and
`deploy/` linked there (read, never written)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
FENCE = re.compile(r"<!-- runnable -->\n```(sh|bash|python)\n(.*?)\n```", re.S)


@dataclass
class Block:
    page: Path
    line: int
    language: str
    code: str


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    return [Block(page, text.count("\n", 0, m.start()) + 2, m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def pages() -> list[Path]:
    return sorted(p for p in DOCS.rglob("*.md") if blocks(p))


def run_page(page: Path, workdir: Path, timeout_s: float = 240.0) -> None:
    """Run every runnable block of `page` in `workdir`; raise AssertionError naming the failing block."""
    shutil.copytree(REPO / "configs", workdir / "configs",
                    ignore=shutil.ignore_patterns("*.msd.*", "*.msdidx.*", ".tmp-msd-*", "__pycache__"))
    for name in ("tools", "deploy"):
        (workdir / name).symlink_to(REPO / name, target_is_directory=True)
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    groups = []
    try:
        for i, block in enumerate(blocks(page)):
            if block.language == "python":
                script = workdir / f".block{i}.py"
                script.write_text(block.code + "\n")
                cmd = [sys.executable, str(script)]
            else:
                cmd = ["bash", "-e", "-o", "pipefail", "-c", block.code]
            proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True, start_new_session=True)
            groups.append(proc.pid)
            try:
                out, _ = proc.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
                raise AssertionError(f"{page.relative_to(REPO)}:{block.line}: still running after {timeout_s} s\n{out}")
            if proc.returncode != 0:
                raise AssertionError(f"{page.relative_to(REPO)}:{block.line}: exit status {proc.returncode}\n{out}")
    finally:
        for pgid in groups:  # what a block left running in the background (a coordinator)
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
