"""`msd manifest` and `msd where` against the batches of a real run (a run-time `msd mix` and a
coordinator restart included): what they recompute from the journal is what the ranks received."""

import orjson
import pytest
from click.testing import CliRunner

from coordinator.cli import main
from coordinator.mix import request_mix
from coordinator.testing.local import LocalJob
from tests.conftest import job_dict, write_job

from .harness import run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _manifest(state, step, *extra):
    r = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", str(step), "--json", *extra])
    assert r.exit_code == 0, r.output
    return orjson.loads(r.output)


def test_manifest_equals_what_the_ranks_received_through_a_mix_and_a_restart(dataset_dir, tmp_path):
    path = write_job(dataset_dir, job_dict(), "manifest.yaml")
    state = str(tmp_path / "state")
    steps, events = 30, []

    def during(cluster, batches):  # 2 ranks x 2 micro-batches per step
        if batches >= 8 and "mix" not in events:
            ok, reason = request_mix(cluster.address, 16, {"web": 0.1, "code": 0.1, "long": 0.8})
            assert ok, reason
            events.append("mix")
        if batches >= 80 and "restart" not in events:
            cluster.restart_coordinator()
            events.append("restart")

    with LocalJob(path, workers=2, log_level="INFO", state_dir=state, log_path=str(tmp_path / "log")) as cluster:
        received, _ = run_ranks(cluster, ranks=2, steps=steps, during=during, timeout_s=180)
    assert events == ["mix", "restart"]

    got = {}  # (step, rank, micro_batch) -> [(doc_key, offset, length), ...]
    for rank, batches in received.items():
        for b in batches:
            got[(b["step"], rank, b["micro_batch"])] = list(zip(b["doc_keys"].tolist(), b["doc_offsets"].tolist(),
                                                                 b["piece_lengths"].tolist()))
    long_share = []
    for step in range(steps):
        m = _manifest(state, step)
        assert m["step"] == step and m["dp"] == 2
        for rank, pieces in m["ranks"].items():
            for mb in (0, 1):
                want = [(p["doc_key"], p["offset"], p["length"]) for p in pieces if p["micro_batch"] == mb]
                assert want == got[(step, int(rank), mb)], (step, rank, mb)
        long_share.append(m["source_tokens"]["long"] / sum(m["source_tokens"].values()))
    assert max(long_share[:16]) < 0.5 < min(long_share[17:])  # the mix took effect at step 16

    # one rank, resolved to files and lines
    one = _manifest(state, 20, "--rank", "1", "--resolve")
    assert list(one["ranks"]) == ["1"]
    for p in one["ranks"]["1"]:
        assert p["where"] and (p["source"] != "web" or ".jsonl:" in p["where"])
    r = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", "20", "--rank", "0"])
    assert r.exit_code == 0 and "rank 0" in r.output and "rank 1" not in r.output, r.output
    r = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", "5000"])
    assert r.exit_code == 1 and "not planned" in r.output

    # msd where: a document seen in steps 10..20 is found at every step and rank it was delivered
    key = got[(12, 0, 0)][0][0]
    want = sorted((s, r, mb, off, n) for (s, r, mb), pieces in got.items() if 10 <= s < 20
                  for k, off, n in pieces if k == key)
    r = CliRunner().invoke(main, ["where", "--state-dir", state, "--steps", "10:20", "--json", str(key)])
    assert r.exit_code == 0, r.output
    found = orjson.loads(r.output)["deliveries"]
    assert sorted((f["step"], f["rank"], f["micro_batch"], f["offset"], f["length"]) for f in found) == want
