"""Worker hosts with `--procs auto`: the coordinator grows a host while trainers wait for an
expensive source and shrinks it when workers idle, without changing the stream."""

import math
import os
import re
import subprocess
import sys
import urllib.request
from types import SimpleNamespace

import pytest

from msd.testing.multimodal_data import write_webdataset
from tests.conftest import write_job
from msd_common.formats.megatron import write_megatron
from msd_common.tokenizer import ByteTokenizer

from msd.testing.ports import free_address, free_port
from msd.testing.processes import stop

from .harness import check_content, run_job, run_ranks, signature

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAST_STEPS = 90  # trainers that take no time: workers cannot keep up, the host must grow
# then slow trainers (0.25 s per micro-batch): workers idle, the host must shrink. The shrink
# came ~7 s into the slow steps here (idle measured, then the retired worker's records drained
# for shrink_after_s); 30 slow steps (~11 s) left too little room on a loaded CI machine.
STEPS = 140


@pytest.fixture(scope="module")
def job_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("autoscale")
    (root / "images").mkdir()
    write_webdataset(str(root / "images" / "a.tar"), 60, seed=3, sizes=(300, 700), formats=("jpg", "png"))
    tok = ByteTokenizer()
    write_megatron(str(root / "text_document"), [tok.encode("token " * (50 + 7 * i)) for i in range(200)], "uint16")
    return write_job(str(root), {
        "seed": 5,
        "sources": {
            "text": {"format": "megatron", "paths": ["text_document"]},
            "images": {"format": "webdataset", "paths": ["images/*.tar"], "image_token_id": 300,
                       "max_pixels": 224 * 224, "patch_size": 14},
        },
        "batch": {"seq_len": 2048, "micro_batch_size": 1, "global_batch_size": 4},
        "topology": {"dp": 2},
        "mixture": {"weights": {"text": 0.5, "images": 0.5}},
        "runtime": {"heartbeat_s": 0.5, "prepare_batch": 4, "lookahead_steps": 3, "shrink_after_s": 3.0},
    }, "auto.yaml")


def test_host_grows_under_load_shrinks_when_idle_and_the_stream_is_unchanged(job_path, tmp_path):
    log = str(tmp_path / "auto.log")
    auto = run_job(job_path, workers=None, max_procs=2, ranks=2, steps=STEPS, log_path=log, timeout_s=240,
                   compute_s=[(0, 0.0), (FAST_STEPS, 0.25)])
    text = open(log).read()
    assert re.search(r"worker host \S+: 1 -> 2 processes \(trainers wait", text), "the host never grew"
    assert re.search(r"worker \d+ holds nothing; stopping it \(1 processes\)", text), "the host never shrank"
    assert "worker processes: 1 -> 2" in text and "stopping worker process" in text  # the agent did both
    reference = run_job(job_path, workers=1, ranks=2, steps=STEPS)
    assert signature(auto) == signature(reference)
    assert check_content(job_path, auto) > 100


def _hpa_desired(hpa: dict, value: float, current: int) -> int:
    """What Kubernetes' HorizontalPodAutoscaler decides for one External metric of type
    AverageValue: ceil(metric / target per pod), within min and max replicas."""
    (metric,) = hpa["spec"]["metrics"]
    target = float(metric["external"]["target"]["averageValue"])
    wanted = math.ceil(value / target) if value else current
    return max(hpa["spec"]["minReplicas"], min(hpa["spec"]["maxReplicas"], wanted))


def _gauge(port: int, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def test_the_chart_autoscaler_asks_for_more_worker_pods_while_trainers_wait(job_path, tmp_path):
    """The coordinator exports msd_workers_wanted; the chart's HorizontalPodAutoscaler (rendered
    with autoscaling on) turns it into worker pods. A worker pod of one process at its limit while
    trainers wait for data: more pods wanted; trainers that compute slowly: back to one."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "tools"))
    import render_chart

    objects = render_chart.objects(render_chart.render(
        {"workers": {"procs": 1, "maxProcs": 1, "autoscaling": {"enabled": True, "maxReplicas": 8}}}))
    (hpa,) = [o for o in objects if o["kind"] == "HorizontalPodAutoscaler"]
    address, metrics = free_address(), free_port()
    msd = os.path.join(os.path.dirname(sys.executable), "msd")
    log = open(tmp_path / "processes.log", "ab")
    coordinator = subprocess.Popen([msd, "coordinator", "--config", job_path, "--bind", address,
                                    "--metrics-port", str(metrics)], stdout=log, stderr=log)
    worker = subprocess.Popen([msd, "worker", "--coordinator", address, "--procs", "1"], stdout=log, stderr=log)
    seen: list[float] = []

    def during(_cluster, n):
        value = _gauge(metrics, "msd_workers_wanted")
        if value is not None:
            seen.append(value)

    try:
        run_ranks(SimpleNamespace(address=address), ranks=2, steps=STEPS, timeout_s=240, during=during,
                  compute_s=[(0, 0.0), (FAST_STEPS, 0.25)])
        last = _gauge(metrics, "msd_workers_wanted")
    finally:
        stop([worker, coordinator])
    assert seen, "no msd_workers_wanted from the coordinator"
    assert max(seen) > 1, seen  # trainers waited on a host at its limit: more processes wanted
    assert _hpa_desired(hpa, max(seen), current=1) > 1
    assert last == 1.0 and _hpa_desired(hpa, last, current=int(max(seen))) == 1, (last, seen[-10:])
