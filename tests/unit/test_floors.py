"""The floors of the code, checked on its import lines (issue 44): each role meets the others on the
wire only, and what they share stands below all of them.

    msd                  the `msd` command and what composes several roles (one-command mode,
                         plan/manifest/report over local data, the test cluster)
    coordinator  worker  trainer_client      the roles: none imports another, nor msd
    msd_common           the floor they share: the wire, the typed job spec, records by format

Old module paths kept for a release (CHANGELOG.md) are aliases that point down, never up.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
PACKAGES = ("msd_common", "coordinator", "worker", "trainer_client", "msd")
# what each package may import of the others
ALLOWED = {
    "msd_common": set(),
    "coordinator": {"msd_common"},
    "worker": {"msd_common"},
    "trainer_client": {"msd_common"},
    "msd": {"msd_common", "coordinator", "worker", "trainer_client"},
}


def imports_of(path: str, package: str) -> set[str]:
    """The top-level packages of ours that a module imports (absolute or relative, at any depth)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module:
                out.add(node.module.split(".")[0])
            elif node.level:  # relative: stays in its own package, as far as it climbs
                out.add(package)
    return out & set(PACKAGES)


def modules() -> list[tuple[str, str]]:
    found = []
    for package in PACKAGES:
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            found += [(package, os.path.join(folder, f)) for f in files if f.endswith(".py")]
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_the_floors_below_it(package):
    wrong = {os.path.relpath(path, ROOT): sorted(imports_of(path, package) - ALLOWED[package] - {package})
             for p, path in modules() if p == package}
    assert {path: names for path, names in wrong.items() if names} == {}


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from worker.host import HostAgent\n")
    assert imports_of(str(bad), "coordinator") - ALLOWED["coordinator"] - {"coordinator"} == {"worker"}
