"""The rendered chart run as pods, without a cluster (tests/deploy/kubelet.py): the coordinator
StatefulSet with its standby, the worker Deployment, a JobSet of two trainer pods with their relay
and worker sidecars, CURVE keys from a Secret, each pod in its own network namespace with Service names
resolving, each container as the pod's non-root user on a read-only root file system, from a
venv installed by tools/install.sh as the image is. A worker pod is killed and replaced as its
Deployment would; the serving coordinator is killed, the standby takes over, and the killed pod,
started again as its StatefulSet would, stands by. The ranks' stream equals the same job's started
by hand.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import numpy as np
import pytest
import yaml

from tests.conftest import job_dict, write_job
from tests.integration.harness import check_content, run_job, signature

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import render_chart  # noqa: E402

from .kubelet import Cluster, secret_from_files  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

STEPS = 16
NODES, PER_NODE = 2, 2
COMPUTE_S = 0.3


def _needs_namespaces() -> None:
    if os.geteuid() != 0 or not all(shutil.which(t) for t in ("ip", "unshare", "setpriv", "mount")):
        pytest.skip("needs root, iproute2 and util-linux to run pods in namespaces")


def _python_for_others() -> str:
    """A Python >= 3.11 that the pods' user may run: an image has its own in /usr/local; here the
    project's may live under root's home, which others cannot enter."""
    for candidate in (os.path.realpath(sys.executable), "/usr/local/bin/python3", "/usr/bin/python3"):
        path = os.path.realpath(candidate)
        parents = [os.path.dirname(path)]
        while parents[-1] != "/":
            parents.append(os.path.dirname(parents[-1]))
        if not os.path.exists(path) or not all(os.stat(d).st_mode & 0o001 for d in parents):
            continue
        version = subprocess.run([path, "-c", "import sys, venv; print(sys.version_info >= (3, 11))"],
                                 capture_output=True, text=True)
        if version.stdout.strip() == "True":
            return path
    pytest.skip("no Python >= 3.11 with venv that a non-root user may run")


@pytest.fixture(scope="module")
def image():
    """The image's environment: a venv made by tools/install.sh as the Dockerfile makes /opt/msd
    (no extras, no torch), outside /tmp (each pod mounts its own /tmp)."""
    _needs_namespaces()
    venv = tempfile.mkdtemp(prefix="msd-image-", dir="/var/tmp")
    os.chmod(venv, 0o755)
    subprocess.run([os.path.join(ROOT, "tools", "install.sh"), venv], check=True, capture_output=True,
                   env={**os.environ, "PYTHON": _python_for_others()})
    yield venv
    shutil.rmtree(venv, ignore_errors=True)


@pytest.fixture
def work(dataset_dir):
    """A folder outside /tmp the pods' user can read: the data (a copy), the coordinators'
    shared claim, the trainers' results."""
    _needs_namespaces()
    root = tempfile.mkdtemp(prefix="msd-k8s-", dir="/var/tmp")
    os.chmod(root, 0o755)
    shutil.copytree(dataset_dir, os.path.join(root, "data"))
    subprocess.run(["chmod", "-R", "a+rX", os.path.join(root, "data")], check=True)
    for d in ("results", "state"):
        os.makedirs(os.path.join(root, d), mode=0o777)
        os.chmod(os.path.join(root, d), 0o777)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _job(data: str) -> dict:
    job = job_dict(topology={"dp": NODES * PER_NODE}, batch={"seq_len": 512, "micro_batch_size": 2,
                                                             "global_batch_size": 8})
    for source in job["sources"].values():  # paths inside the pods: the data volume's
        source["paths"] = [os.path.join(data, p) for p in source["paths"]]
    return job


def _progress(results: str) -> int:
    """The step every rank has reached (-1 before the first)."""
    steps = []
    for r in range(NODES * PER_NODE):
        try:
            steps.append(int(open(os.path.join(results, f"progress-{r}")).read() or -1))
        except (FileNotFoundError, ValueError):
            steps.append(-1)
    return min(steps)


def _received(results: str) -> dict[int, list[dict]]:
    out = {}
    for r in range(NODES * PER_NODE):
        with np.load(os.path.join(results, f"rank-{r}.npz")) as z:
            n = len({k.split(".")[0] for k in z.files})
            out[r] = [{"step": int(z[f"{i}.at"][0]), "micro_batch": int(z[f"{i}.at"][1]),
                       **{f: z[f"{i}.{f}"] for f in ("doc_keys", "doc_offsets", "piece_lengths", "tokens")}}
                      for i in range(n)]
    return out


def _metric(cluster: Cluster, pod: str, name: str) -> float | None:
    address = cluster.pods[pod].address
    with urllib.request.urlopen(f"http://{address}:9090/metrics", timeout=3) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return None


def test_rendered_pods_run_the_job_through_a_worker_and_a_coordinator_lost(image, work, tmp_path):
    data, results = (os.path.join(work, d) for d in ("data", "results"))
    logs = str(tmp_path)  # each container's output, kept after the test
    job = _job(data)
    keys = os.path.join(work, "keys")
    subprocess.run([os.path.join(image, "bin", "msd"), "keys", "generate", keys], check=True, capture_output=True)
    trainer_script = os.path.join(ROOT, "tests", "deploy", "kube_trainer.py")
    values = {
        "image": {"repository": "msd", "tag": "test"},
        "logFormat": "text",
        "job": yaml.safe_dump(job, sort_keys=False),
        "data": {"mountPath": data, "volume": {"hostPath": {"path": data, "type": "Directory"}}},
        "coordinator": {"standby": True},
        # one CPU pod, and a worker sidecar in each trainer pod (the paper's deployment)
        "workers": {"deployment": {"replicas": 1}, "procs": 1, "maxProcs": 1, "sidecar": {"enabled": True,
                                                                                          "maxProcs": 1}},
        "trainer": {"kind": "jobset", "image": "msd:test", "command": [os.path.join(image, "bin", "python"),
                                                                       trainer_script], "args": [],
                    "nodes": NODES, "procsPerNode": PER_NODE, "resources": {},
                    "env": [{"name": "MSD_TEST_STEPS", "value": str(STEPS)},
                            {"name": "MSD_TEST_RESULTS", "value": results},
                            {"name": "MSD_TEST_COMPUTE_S", "value": str(COMPUTE_S)}],
                    "volumes": [{"name": "results", "hostPath": {"path": results}}],
                    "volumeMounts": [{"name": "results", "mountPath": results}]},
        "security": {"curve": {"secretName": "msd-keys"}},
    }
    objects = render_chart.objects(render_chart.render(values))
    cluster = Cluster(objects, work, logs=logs, image_path=f"{image}/bin:/usr/local/bin:/usr/bin:/bin",
                      secrets={"msd-keys": secret_from_files(keys)},
                      claims={"msd-coordinator-state": os.path.join(work, "state")})
    events: dict[str, float] = {}
    try:
        coordinator = cluster.template("StatefulSet", "msd-coordinator")
        for i in (0, 1):
            cluster.start(f"msd-coordinator-{i}", coordinator)
        roles = {}
        for i in (0, 1):
            roles[i] = cluster.wait_ready(f"msd-coordinator-{i}", "coordinator", timeout_s=90)
        # both start as standbys; the first to find the lease free serves, the other stands by
        deadline = time.monotonic() + 30
        while sorted('"active"' in roles[i] for i in (0, 1)) != [False, True]:
            assert time.monotonic() < deadline, roles
            time.sleep(0.5)
            roles = {i: cluster.probe(f"msd-coordinator-{i}", "coordinator")[1] for i in (0, 1)}
        active = next(i for i in (0, 1) if '"active"' in roles[i])
        assert '"standby"' in roles[1 - active]

        workers = cluster.template("Deployment", "msd-workers")
        worker_pods = ["msd-workers-7d9f-a1b2c"]
        for name in worker_pods:
            cluster.start(name, workers)
        for name in worker_pods:
            cluster.wait_ready(name, "msd-worker", timeout_s=90)  # registered with the serving coordinator

        trainers = cluster.template("JobSet", "msd-train")
        trainer_pods = [f"msd-train-trainer-0-{i}" for i in range(NODES)]
        for i, name in enumerate(trainer_pods):
            cluster.start(name, trainers, annotations={"batch.kubernetes.io/job-completion-index": str(i)})
        for name in trainer_pods:
            cluster.wait_ready(name, "msd-relay", timeout_s=60, kind="startupProbe")
            cluster.wait_ready(name, "msd-worker", timeout_s=90)  # the sidecar, with the worker role's keys

        deadline = time.monotonic() + 300
        while any(cluster.pods[n].processes["trainer"].poll() is None for n in trainer_pods):
            assert time.monotonic() < deadline, f"trainers did not finish; progress {_progress(results)}"
            step = _progress(results)
            if "worker killed" not in events and step >= 3:  # a node lost: its Deployment starts another pod
                cluster.kill(worker_pods[0])
                worker_pods[0] = "msd-workers-7d9f-x9y8z"
                cluster.start(worker_pods[0], workers)
                events["worker killed"] = step
            if "coordinator killed" not in events and step >= 7:
                cluster.kill(f"msd-coordinator-{active}")
                events["coordinator killed"] = step
                events["killed at"] = time.monotonic()
            if "coordinator killed" in events and "took over" not in events:
                if '"active"' in cluster.probe(f"msd-coordinator-{1 - active}", "coordinator")[1]:
                    events["took over"] = time.monotonic() - events["killed at"]
                    # the StatefulSet starts the lost pod again, under the same name: it stands by
                    cluster.start(f"msd-coordinator-{active}", coordinator)
            time.sleep(0.3)
        codes = {n: cluster.pods[n].processes["trainer"].returncode for n in trainer_pods}
        assert set(codes.values()) == {0}, (codes, {n: cluster.log(n, "trainer")[-2000:] for n in trainer_pods})
        assert {"worker killed", "coordinator killed", "took over"} <= events.keys(), events
        assert events["took over"] < 20, events
        restarted = cluster.wait_ready(f"msd-coordinator-{active}", "coordinator", timeout_s=60)
        assert '"standby"' in restarted
        assert '"active"' in cluster.probe(f"msd-coordinator-{1 - active}", "coordinator")[1]
        # 3 worker hosts of 1 process each (a CPU pod, the lost one forgotten, and 2 sidecars), none
        # short: the autoscaler's metric, from the coordinator that took over, asks for what runs
        deadline = time.monotonic() + 15
        while _metric(cluster, f"msd-coordinator-{1 - active}", "msd_workers_wanted") != 1.0 + NODES:
            assert time.monotonic() < deadline, _metric(cluster, f"msd-coordinator-{1 - active}", "msd_workers_wanted")
            time.sleep(0.5)
        # nothing written outside the volumes: the root file system stayed read-only, and the
        # job ran as the pods' user
        for name in (*trainer_pods, f"msd-coordinator-{1 - active}"):
            for container, p in cluster.pods[name].processes.items():
                assert "Read-only file system" not in cluster.log(name, container), (name, container)
        assert os.stat(os.path.join(work, "state", "lease")).st_uid == 10001
    finally:
        cluster.close()
    received = _received(results)

    path = write_job(work, job, "by-hand.yaml")
    by_hand = run_job(path, workers=1, ranks=NODES * PER_NODE, steps=STEPS, timeout_s=180)
    assert signature(received) == signature(by_hand)
    assert check_content(path, received) > 50
