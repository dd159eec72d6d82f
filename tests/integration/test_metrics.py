"""`msd coordinator --metrics-port`: a job run through the msd commands and two DataClients, its
Prometheus metrics scraped over HTTP and parsed with prometheus-client's own parser."""

import os
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from msd.testing.ports import free_port
from msd.testing.processes import stop
from tests.conftest import job_dict, write_job
from trainer_client import DataClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _samples(text: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_the_coordinator_and_workers_serve_prometheus_metrics_of_the_running_job(dataset_dir, tmp_path):
    path = write_job(dataset_dir, job_dict(), "metrics.yaml")
    address, metrics_port, worker_port = f"tcp://127.0.0.1:{free_port()}", free_port(), free_port()
    msd = os.path.join(os.path.dirname(sys.executable), "msd")
    procs = [subprocess.Popen([msd, "coordinator", "--config", path, "--bind", address, "--metrics-port",
                               str(metrics_port), "--state-dir", str(tmp_path / "state")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL),
             subprocess.Popen([msd, "worker", "--coordinator", address, "--procs", "2", "--metrics-port",
                               str(worker_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        done, scraped = threading.Barrier(3), threading.Event()

        def rank(r: int) -> None:
            with DataClient(address, rank=r, as_torch=False, timeout_s=60) as client:
                for batch in client:
                    if batch["step"] >= 12:
                        break
                done.wait(90)
                scraped.wait(30)  # still registered while the metrics are read

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        done.wait(90)
        time.sleep(1.5)  # a heartbeat or two: the gauges are copied once per heartbeat
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        worker_text = urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/metrics", timeout=10).read().decode()
        scraped.set()
        for t in threads:
            t.join(30)
    finally:
        stop(procs)
    samples = _samples(text)
    names = {name for name, _ in samples}
    for expected in ("msd_messages_received_total", "msd_messages_sent_total", "msd_steps_planned",
                     "msd_workers_alive", "msd_source_tokens_planned_total", "msd_mixture_target_share",
                     "msd_step_rank_cost_max_over_mean_bucket", "msd_planning_seconds_count",
                     "msd_rank_data_wait_seconds_total", "msd_skipped_records_total", "msd_steps_journaled",
                     "msd_mixture_realised_share", "msd_source_tokens_delivered_total", "msd_records_reprepared_total",
                     "msd_messages_dropped_total"):
        assert expected in names, expected
    assert samples[("msd_steps_planned", ())] >= 13
    assert 13 <= samples[("msd_steps_journaled", ())] <= samples[("msd_steps_planned", ())]
    assert samples[("msd_journal_write_seconds_count", (("kind", "AppendJournal"),))] >= 1
    assert samples[("msd_workers_alive", ())] == 2
    assert samples[("msd_messages_received_total", (("type", "consumed"),))] >= 2 * 12
    # a bad line of web-1.jsonl met so far (how many by step 12 depends on how far ahead records are prepared)
    assert samples[("msd_skipped_records_total", (("kind", "corrupt"), ("source", "web")))] >= 1
    assert samples[("msd_rank_data_wait_seconds_total", (("rank", "0"),))] >= 0
    assert samples[("msd_records_reprepared_total", ())] == 0
    delivered = {dict(k)["source"]: v for (n, k), v in samples.items() if n == "msd_source_tokens_delivered_total"}
    assert sum(delivered.values()) >= 12 * 8 * 512  # every step up to 12 consumed by both ranks: 8 x 512 tokens
    realised = samples[("msd_mixture_realised_share", (("source", "web"),))]
    assert abs(realised - 0.5) < 0.05
    assert samples[("msd_mixture_target_share", (("source", "web"),))] == pytest.approx(0.5)
    web = samples[("msd_source_tokens_planned_total", (("source", "web"),))]
    total = sum(v for (n, _), v in samples.items() if n == "msd_source_tokens_planned_total")
    assert 0.4 < web / total < 0.6

    # the worker host: its two processes' metrics on one port
    w = _samples(worker_text)
    prepared = {dict(k)["source"]: v for (n, k), v in w.items() if n == "msd_worker_records_prepared_total"}
    assert prepared.get("web", 0) > 0 and prepared.get("long", 0) > 0  # code (Megatron) needs no prepare
    assert w[("msd_worker_pieces_sent_total", ())] > 0
    assert w[("msd_worker_busy_seconds_total", ())] > 0
    assert ("msd_worker_send_waits_total", ()) in w
    shares = [v for (n, _), v in w.items() if n == "msd_worker_busy_share"]
    assert len(shares) == 2 and all(0 <= v <= 1 for v in shares)  # one per live process (label pid)
    per_token = [v for (n, k), v in w.items() if n == "msd_worker_seconds_per_token" and dict(k)["source"] == "web"]
    assert per_token and all(0 < v < 1e-3 for v in per_token)
    tokens = {dict(k)["source"]: v for (n, k), v in w.items() if n == "msd_worker_tokens_prepared_total"}
    assert tokens["web"] > prepared["web"]

    # the Grafana dashboard asks only for metrics that exist
    import json
    import re

    dashboard = json.load(open(os.path.join(os.path.dirname(__file__), "..", "..", "tools", "grafana",
                                            "msd-dashboard.json")))
    exported = {name for name, _ in samples} | {name for name, _ in w}
    asked = {m for p in dashboard["panels"] for t in p["targets"] for m in re.findall(r"msd_[a-z_]+", t["expr"])}
    assert len(asked) >= 15 and asked <= exported, asked - exported


def test_log_format_json_gives_one_object_per_line_from_every_process(dataset_dir, tmp_path):
    """msd coordinator and msd worker with --log-format json: every line of their stderr (the
    coordinator's, the host agent's, its worker processes') is one JSON object, with the step,
    source or peer where the record has one."""
    import orjson

    path = write_job(dataset_dir, job_dict(topology={"dp": 1}), "jsonlogs.yaml")
    address = f"tcp://127.0.0.1:{free_port()}"
    msd = os.path.join(os.path.dirname(sys.executable), "msd")
    logs = [tmp_path / "coordinator.log", tmp_path / "worker.log"]
    with open(logs[0], "wb") as c_err, open(logs[1], "wb") as w_err:
        procs = [subprocess.Popen([msd, "coordinator", "--config", path, "--bind", address, "--log-format", "json"],
                                  stdout=subprocess.DEVNULL, stderr=c_err),
                 subprocess.Popen([msd, "--log-format", "json", "worker", "--coordinator", address, "--procs", "2"],
                                  stdout=subprocess.DEVNULL, stderr=w_err)]
        try:
            with DataClient(address, rank=0, as_torch=False, timeout_s=60) as client:
                for batch in client:
                    if batch["step"] >= 20:
                        break
        finally:
            stop(procs)
    records = []
    for log in logs:
        for line in log.read_text().splitlines():
            records.append(orjson.loads(line))  # every line parses
    assert {r["role"] for r in records} >= {"coordinator", "worker-host", "worker"}
    assert all({"time", "level", "pid", "logger", "message"} <= r.keys() for r in records)
    planned = [r for r in records if r["message"].startswith("step 0 planned")]
    assert planned and planned[0]["step"] == 0
    skipped = [r for r in records if r["role"] == "worker" and "skipped record" in r["message"]]
    assert skipped and all(r["source"] == "web" and isinstance(r["record"], int) for r in skipped)
    assert any(r.get("rank") == 0 and "peer" in r for r in records if r["role"] == "coordinator")
