"""`msd coordinator --metrics-port`: a job run through the msd commands and two DataClients, its
Prometheus metrics scraped over HTTP and parsed with prometheus-client's own parser."""

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from tests.conftest import job_dict, write_job
from trainer_client import DataClient

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_coordinator_serves_prometheus_metrics_of_the_running_job(dataset_dir):
    from prometheus_client.parser import text_string_to_metric_families

    path = write_job(dataset_dir, job_dict(), "metrics.yaml")
    address, metrics_port = f"tcp://127.0.0.1:{_port()}", _port()
    msd = os.path.join(os.path.dirname(sys.executable), "msd")
    procs = [subprocess.Popen([msd, "coordinator", "--config", path, "--bind", address, "--metrics-port",
                               str(metrics_port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
             subprocess.Popen([msd, "worker", "--coordinator", address, "--procs", "2"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
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
        scraped.set()
        for t in threads:
            t.join(30)
    finally:
        for p in procs:
            p.terminate()
            p.wait(20)
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    names = {name for name, _ in samples}
    for expected in ("msd_messages_received_total", "msd_messages_sent_total", "msd_steps_planned",
                     "msd_workers_alive", "msd_source_tokens_planned_total", "msd_mixture_target_share",
                     "msd_step_rank_cost_max_over_mean_bucket", "msd_planning_seconds_count",
                     "msd_rank_data_wait_seconds", "msd_skipped_records"):
        assert expected in names, expected
    assert samples[("msd_steps_planned", ())] >= 13
    assert samples[("msd_workers_alive", ())] == 2
    assert samples[("msd_messages_received_total", (("type", "consumed"),))] >= 2 * 12
    assert samples[("msd_skipped_records", (("kind", "corrupt"), ("source", "web")))] >= 2  # the two bad lines
    assert samples[("msd_mixture_target_share", (("source", "web"),))] == pytest.approx(0.5)
    web = samples[("msd_source_tokens_planned_total", (("source", "web"),))]
    total = sum(v for (n, _), v in samples.items() if n == "msd_source_tokens_planned_total")
    assert 0.4 < web / total < 0.6
