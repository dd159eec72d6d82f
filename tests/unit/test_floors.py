"""The floors of the code, checked on its import lines (issue 44): each role meets the others on the
wire only, and what they share stands below all of them (tools/floors.py says which may import
which). The relay is a role of its own (issue 58); the old module paths kept for a release are gone."""

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
    for role in floors.ROLES:
        assert graph[role] == {"msd_common"}, role
    assert set(floors.ROLES) == {"coordinator", "worker", "relay", "trainer_client"}


def test_the_wire_and_the_formats_do_not_load_the_job_spec():
    """A worker host or a trainer decodes messages and reads records without the job file's parser."""
    import subprocess

    code = ("import sys, msd_common.protocol, msd_common.wire, msd_common.formats.records, "
            "msd_common.formats.indexing, msd_common.formats.jsonl, msd_common.formats.megatron; "
            "print('msd_common.spec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_module_is_an_alias_of_an_old_path():
    """The aliases kept for one release (0.4.0) are removed, as CHANGELOG promised."""
    aliases = [os.path.relpath(path, floors.ROOT) for _, path in floors.modules()
               if floors.summary(path).startswith("Moved to") or "sys.modules[__name__] =" in open(path).read()]
    assert aliases == []


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
