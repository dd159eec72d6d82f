"""The reference cannot drift: every job-file key, command flag, metric and batch key has an entry
with a meaning, and the job-file checker accepts exactly the keys the reference lists."""

from __future__ import annotations

import re
import sys

import click
import numpy as np
import pytest

from msd_common.spec import ConfigError, parse_job
from msd_common.job_keys import KEYS, allowed
from trainer_client.batch import BATCH_KEYS

from .runnable import REPO

sys.path.insert(0, str(REPO / "tools"))
import docgen  # noqa: E402


def test_every_job_key_has_a_type_default_and_meaning() -> None:
    assert len({k.path for k in KEYS}) == len(KEYS)
    for k in KEYS:
        assert k.type and k.default and len(k.meaning) > 15, k
    page = docgen.job_keys_md()
    for k in KEYS:
        assert docgen._name(k.path) in page, k.path


def test_the_checker_takes_its_keys_from_the_reference() -> None:
    source = (REPO / "msd_common" / "spec.py").read_text()
    calls = re.findall(r"c\.mapping\(([^\n]*)", source)
    assert len(calls) >= 10
    for call in calls:  # every mapping the checker reads names its allowed keys through job_keys
        if '.weights"' in call:  # but a mixture's weights, keyed by the job's own source names
            continue
        assert "allowed" in call, call


@pytest.mark.parametrize("parent,where", [("", "zz_unknown"), ("batch", "batch.zz_unknown"),
                                          ("sources.<name>", "sources.web.zz_unknown"),
                                          ("runtime", "runtime.zz_unknown"), ("balance", "balance.zz_unknown")])
def test_a_key_not_in_the_reference_is_refused(tmp_path, parent, where) -> None:
    data = tmp_path / "web.jsonl"
    data.write_text('{"text": "hello"}\n')
    job = {"seed": 1, "sources": {"web": {"format": "jsonl", "paths": [str(data)]}},
           "batch": {"seq_len": 64, "micro_batch_size": 1, "global_batch_size": 2}, "topology": {"dp": 2},
           "mixture": {"weights": {"web": 1.0}}, "runtime": {}, "balance": {}}
    node = {"": job, "batch": job["batch"], "sources.<name>": job["sources"]["web"], "runtime": job["runtime"],
            "balance": job["balance"]}[parent]
    assert "zz_unknown" not in allowed(parent)
    node["zz_unknown"] = 1
    with pytest.raises(ConfigError) as e:
        parse_job(job, str(tmp_path / "job.yaml"))
    assert any(p.startswith(f"{where}: unknown key") for p in e.value.problems), e.value.problems


def test_every_command_and_flag_has_help() -> None:
    found = list(docgen.commands())
    names = {name for name, _ in found}
    assert {"msd coordinator", "msd worker", "msd validate", "msd plan", "msd report", "msd keys generate"} <= names
    page = docgen.cli_md()
    for name, cmd in found:
        assert (cmd.help or "").strip(), f"{name}: no help"
        assert f"### `{name}`" in page
        for p in cmd.params:
            if isinstance(p, click.Option):
                assert (p.help or "").strip(), f"{name} {p.opts[0]}: no help"
                assert docgen._name(p.opts[0]) in page, (name, p.opts[0])


def test_every_metric_has_a_meaning_and_an_entry() -> None:
    families = docgen.metric_families()
    names = [f[0] for f in families]
    assert len(names) == len(set(names)) and len(names) >= 30
    assert {"msd_rank_data_wait_seconds_total", "msd_eval_loss", "msd_cost_coefficient",
            "msd_worker_records_prepared_total"} <= set(names)
    page = docgen.metrics_md()
    for name, kind, doc, process, labels in families:
        assert name.startswith("msd_") and len(doc) > 10, name
        assert docgen._name(name, breaks="_") in page


def test_every_message_of_the_protocol_is_listed() -> None:
    from msd_common import protocol

    page = docgen.protocol_md()
    for name in protocol.ALL_TYPES:
        assert f"| {docgen._name(name)} |" in page, name


def test_every_key_of_a_real_batch_is_in_the_schema() -> None:
    from trainer_client.assemble import assemble_step
    from msd_common.topology import cp_share

    schema = {k.key for k in BATCH_KEYS}
    pieces = {(1 << 48 | 7, 0, 5): np.arange(5, dtype=np.int32), (2 << 48 | 9, 0, 3): np.arange(3, dtype=np.int32)}
    (mb,) = assemble_step([[(1 << 48 | 7, 0, 5), (2 << 48 | 9, 0, 3)]], pieces, seq_len=8, pad_id=0,
                          micro_batch_size=1)
    keys = set(mb) | set(cp_share(mb, cp=2, cp_rank=0, pad_id=0))
    assert keys <= schema, keys - schema
    # the keys a DataClient adds (step, plan, eval_set, ...) are checked on real batches in
    # tests/integration/test_eval.py and test_e2e.py
