"""`msd manifest` and `msd where` against the batches of a real run (a run-time `msd mix` and a
coordinator restart included): what they recompute from the journal is what the ranks received."""

import orjson
import pytest
from click.testing import CliRunner

from msd.cli import main
from coordinator.mix import request_mix
from msd.testing.local import LocalJob
from tests.conftest import job_dict, write_job
from msd_common.doc_keys import split_doc_key

from .harness import manifest, manifest_pieces, received_pieces, run_ranks

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


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
    for step in range(steps):
        got.update({(step, *at): pieces for at, pieces in received_pieces(received, step).items()})
    long_share = []
    for step in range(steps):
        m = manifest(state, step)
        assert m["step"] == step and m["dp"] == 2
        assert manifest_pieces(m) == received_pieces(received, step), step
        long_share.append(m["source_tokens"]["long"] / sum(m["source_tokens"].values()))
    assert max(long_share[:16]) < 0.5 < min(long_share[17:])  # the mix took effect at step 16

    # the dry run of the same job plans what the run delivered (before the mix changed it)
    r = CliRunner().invoke(main, ["plan", path, "--steps", "16", "--json", "--series"])
    assert r.exit_code == 0, r.output
    dry = orjson.loads(r.output)
    for row in dry["series"]:
        tokens = [0, 0, 0]
        for (step, _, _), pieces in got.items():
            if step == row["step"]:
                for k, _, n in pieces:
                    tokens[split_doc_key(k)[0]] += n
        assert tokens == row["source_tokens"], row["step"]

    # one rank, resolved to files and lines
    one = manifest(state, 20, "--rank", "1", "--resolve")
    assert list(one["ranks"]) == ["1"]
    for p in one["ranks"]["1"]:
        assert p["where"] and (p["source"] != "web" or ".jsonl:" in p["where"])
    r = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", "20", "--rank", "0"])
    assert r.exit_code == 0 and "rank 0" in r.output and "rank 1" not in r.output, r.output
    r = CliRunner().invoke(main, ["manifest", "--state-dir", state, "--step", "5000"])
    assert r.exit_code == 1 and "not planned" in r.output

    # msd report: one HTML file with the plots embedded, and the same plots as a PNG
    html_path, png_path = tmp_path / "report.html", tmp_path / "report.png"
    for out in (html_path, png_path):
        r = CliRunner().invoke(main, ["report", "--state-dir", state, "--out", str(out), "--max-steps", "10"])
        assert r.exit_code == 0, r.output
    _check_report(html_path.read_text(), ["web", "code", "long"])
    assert '<img id="mixture-weights"' in html_path.read_text()  # the msd mix at step 16, plotted
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _look_at_report(html_path)
    # made after the job, it shows what the job measured (issue 48: the wait panel was empty, the
    # last status.json having been written up to 30 s before the end) and only the steps trained on
    from msd.replay import job_of_state_dir, open_replay
    from msd.report import gather

    data = gather(open_replay(state, job_of_state_dir(state)), state)
    assert sorted(data["status"]["data_wait_s"], key=int) == ["0", "1"] and data["status"]["stopped"]
    assert data["steps"] and max(data["steps"]) == steps - 1  # 30 steps consumed: 0..29, none planned ahead

    # msd where: a document seen in steps 10..20 is found at every step and rank it was delivered
    key = got[(12, 0, 0)][0][0]
    want = sorted((s, r, mb, off, n) for (s, r, mb), pieces in got.items() if 10 <= s < 20
                  for k, off, n in pieces if k == key)
    r = CliRunner().invoke(main, ["where", "--state-dir", state, "--steps", "10:20", "--json", str(key)])
    assert r.exit_code == 0, r.output
    found = orjson.loads(r.output)["deliveries"]
    assert sorted((f["step"], f["rank"], f["micro_batch"], f["offset"], f["length"]) for f in found) == want


def _look_at_report(path):
    """The report as a person sees it at 1280 pixels: no errors, every plot drawn, nothing cut off
    behind a horizontal scroll bar."""
    from tests.browser import look, require_browser

    require_browser()
    (seen,) = look([path.as_uri()])
    assert not seen.errors, seen.errors
    assert seen.scroll_width <= 1280, f"the report is {seen.scroll_width} px wide at 1280"
    assert len(seen.images) >= 1 and all(natural > 0 and 0 < shown <= 1280 for _, natural, shown in seen.images), \
        seen.images


def _check_report(text, sources):
    """The report's structure: a valid document, its embedded image a real PNG, a row per source."""
    import base64
    from html.parser import HTMLParser

    class Parser(HTMLParser):
        def __init__(self):
            super().__init__()
            self.images, self.cells, self.open = [], [], []

        def handle_starttag(self, tag, attrs):
            if tag == "img":
                self.images.append(dict(attrs)["src"])
            if tag not in ("img", "meta", "br"):  # void elements have no end tag
                self.open.append(tag)

        def handle_endtag(self, tag):
            assert self.open and self.open[-1] == tag, (tag, self.open[-3:])
            self.open.pop()

        def handle_data(self, data):
            if self.open and self.open[-1] == "td":
                self.cells.append(data)

    p = Parser()
    p.feed(text)
    assert p.open == []  # every element closed
    src = p.images[0]  # the mix, balance and wait panels (then the mixture weights' after run-time changes)
    assert src.startswith("data:image/png;base64,")
    png = base64.b64decode(src.split(",", 1)[1])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    for name in sources:
        assert name in p.cells
    assert "sampled steps" in text and "arrival order" in text


def test_plan_reports_mix_balance_what_ifs_and_workers_needed(dataset_dir, tmp_path):
    stages = [{"until_step": 40, "weights": {"web": 1, "code": 1, "long": 0}},
              {"ramp_steps": 10, "weights": {"web": 0.2, "code": 0.2, "long": 0.6}}]
    path = write_job(dataset_dir, job_dict(mixture=stages), "plan.yaml")
    png = tmp_path / "plan.png"
    r = CliRunner().invoke(main, ["plan", path, "--steps", "30", "--dp", "4", "--seq-len", "2048", "--json",
                                  "--measure",
                                  "--step-time", "0.001", "--plot", str(png)])
    assert r.exit_code == 0, r.output
    report = orjson.loads(r.output)
    assert report["dp"] == 4 and report["seq_len"] == 2048 and "series" not in report
    first, second = report["stages"]
    assert (first["first_step"], second["first_step"]) == (0, 40)
    assert first["mix"]["long"]["realised"] == 0 and abs(first["mix"]["web"]["realised"] - 0.5) < 0.05
    assert second["mix"]["long"]["realised"] > 0.4  # ramped towards 0.6 over the stage's first 10 steps
    for st in (first, second):
        assert st["steps"] == 30 and st["tokens_per_step"] == 4 * 4 * 2048  # 4 sequences per rank, as at dp 2
        assert 1.0 <= st["max_over_mean"] < 1.1
    # documents shorter than a row, dealt in arrival order, are unbalanced
    assert first["naive_max_over_mean"] > first["max_over_mean"] + 0.05 and first["predicted_step_time_gain"] > 1.03
    assert report["skipped_records"] == {"web": 2}  # the two bad lines of web-1.jsonl
    workers = report["workers"]
    assert set(workers["seconds_per_token"]) == {"web", "code", "long"}
    assert all(w["worker_processes"] >= 1 for w in workers["stages"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    r = CliRunner().invoke(main, ["plan", path, "--steps", "5"])
    assert r.exit_code == 0 and "predicted step-time gain" in r.output, r.output
