"""The floors of the code, checked on its import lines (issue 44): each role meets the others on the
wire only, and what they share stands below all of them (tools/floors.py says which may import
which). Old module paths kept for a release are aliases that point down, never up."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import floors  # noqa: E402


def test_no_module_imports_a_floor_it_may_not():
    assert floors.wrong_imports() == {}


def test_the_roles_share_only_the_common_floor():
    graph = floors.package_graph()
    assert graph["msd_common"] == set()
    for role in ("coordinator", "worker", "trainer_client"):
        assert graph[role] == {"msd_common"}


def test_the_check_sees_a_wrong_import(tmp_path):
    (tmp_path / "coordinator").mkdir()
    (tmp_path / "coordinator" / "bad.py").write_text("def f():\n    from worker.host import HostAgent\n")
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "fine.py").write_text("from msd_common import wire\nfrom . import core\n")
    assert floors.wrong_imports(str(tmp_path)) == {os.path.join("coordinator", "bad.py"): ["worker"]}


def test_the_generated_page_lists_every_module():
    page = floors.floors_md()
    assert "<svg" in page and ">state.py<" in page and ">spec.py<" in page and ">formats/records.py<" in page
    assert 'stroke="#d00"' not in page  # no import against the floors drawn
