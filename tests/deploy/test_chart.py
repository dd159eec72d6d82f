"""The Helm chart (deploy/helm/msd), rendered offline by Helm's own code (helm-python-sdk) for
several value sets, every object checked against the Kubernetes schemas of 1.30 to 1.34
(kubernetes-validate, strict: an unknown field fails too), the operators' kinds (JobSet, PyTorchJob,
ServiceMonitor, PodMonitor) against their CRDs' schemas; values the schema refuses are refused;
deploy/kubernetes/ is the chart's default rendering; the image installs as CI does."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import chart_docs  # noqa: E402
import render_chart  # noqa: E402

helm_python = pytest.importorskip("helm_python")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

VERSIONS = ["1.30.0", "1.31.0", "1.32.0", "1.33.0", "1.34.0"]
KEYS = {"security": {"curve": {"secretName": "msd-keys"}}}
VALUE_SETS = {
    "default": None,
    "standby, autoscaled, monitored, CURVE": {
        "coordinator": {"standby": True}, "workers": {"autoscaling": {"enabled": True}},
        "metrics": {"serviceMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True}}, **KEYS},
    "JobSet with worker sidecars, CURVE": {
        "trainer": {"kind": "jobset", "image": "registry.example/train:1"},
        "workers": {"sidecar": {"enabled": True}, "deployment": {"replicas": 0}}, **KEYS},
    "PyTorchJob, existing claim, S3 data": {
        "trainer": {"kind": "pytorchjob", "image": "registry.example/train:1", "nodes": 3},
        "coordinator": {"standby": True, "persistence": {"existingClaim": "msd-state"}}, "data": {"claimName": ""}},
    "one trainer node, fixed worker processes": {
        "trainer": {"kind": "pytorchjob", "image": "t:1", "nodes": 1}, "workers": {"procs": 3, "maxProcs": 3}},
}


def _render(values):
    return render_chart.objects(render_chart.render(values))


CRDS = {name[:-5]: os.path.join(os.path.dirname(__file__), "crds", name)
        for name in os.listdir(os.path.join(os.path.dirname(__file__), "crds")) if name.endswith(".json")}


def _check_custom(obj):
    """An object of an operator's kind against its CRD's schema (tests/deploy/crds/, trimmed from
    the operators' own CRDs; unknown fields refused)."""
    import jsonschema

    schema = json.load(open(CRDS[obj["kind"]]))
    group_version = schema["$comment"].split()[0]
    assert obj["apiVersion"] == group_version, (obj["apiVersion"], group_version)
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, [f"{obj['kind']}: {'.'.join(map(str, e.path))}: {e.message}" for e in errors[:5]]


def _pod_checks(obj):
    """The objects of kinds the Kubernetes schemas do not cover, as the core objects they embed:
    a JobSet's Jobs, a PyTorchJob's pods (their templates are what the chart writes)."""
    if obj["kind"] == "JobSet":
        return [{"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": r["name"]},
                 "spec": r["template"]["spec"]}
                for r in obj["spec"]["replicatedJobs"]]
    if obj["kind"] == "PyTorchJob":
        return [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": role}, "spec": r["template"]["spec"]}
                for role, r in obj["spec"]["pytorchReplicaSpecs"].items()]
    return [obj]


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_every_object_validates_against_kubernetes_1_30_to_1_34(name):
    objects = _render(VALUE_SETS[name])
    kinds = {o["kind"] for o in objects}
    assert {"StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds
    for obj in objects:
        if obj["kind"] in CRDS:  # an operator's kind: its CRD's schema, and the pods inside against Kubernetes'
            _check_custom(obj)
        for checked in _pod_checks(obj):
            if checked["kind"] in CRDS:
                continue
            for version in VERSIONS:
                try:
                    kubernetes_validate.validate(checked, version, strict=True)
                except kubernetes_validate.ValidationError as e:
                    path = ".".join(str(p) for p in e.path)
                    raise AssertionError(f"{name}: {obj['kind']} {obj['metadata']['name']} against {version}: "
                                         f"{path}: {e.message}") from None


def _by_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def _containers(spec):
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_defaults_one_coordinator_on_its_own_claim_and_hardened_pods():
    objects = _render(None)
    (sts,) = _by_kind(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == 1
    assert [t["spec"]["accessModes"] for t in sts["spec"]["volumeClaimTemplates"]] == [["ReadWriteOnce"]]
    (service,) = _by_kind(objects, "Service")
    assert service["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == service["metadata"]["name"]
    args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--standby" not in args and "--state-dir=/var/lib/msd/state" in args
    (deployment,) = _by_kind(objects, "Deployment")
    worker_args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--coordinator=tcp://msd-coordinator-0.msd-coordinator:5555" in worker_args
    for workload in (sts, deployment):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"]:
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert c["livenessProbe"] and c["readinessProbe"] and c["resources"]["requests"]
            # every writable path is a volume: the root file system is read-only
            assert {"/tmp", "/var/cache/msd"} <= {m["mountPath"] for m in c["volumeMounts"]}
    job = yaml.safe_load(_by_kind(objects, "ConfigMap")[0]["data"]["job.yaml"])
    assert job["sources"]["web"]["paths"] == ["/data/web/*.jsonl.zst"] and "security" not in job
    assert not _by_kind(objects, "Secret")  # keys come from a Secret the operator makes, never from values


def test_standby_pair_shares_a_read_write_many_claim_and_every_client_lists_both():
    objects = _render(VALUE_SETS["standby, autoscaled, monitored, CURVE"])
    (sts,) = _by_kind(objects, "StatefulSet")
    assert sts["spec"]["replicas"] == 2 and "volumeClaimTemplates" not in sts["spec"]
    (claim,) = _by_kind(objects, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    pod = sts["spec"]["template"]["spec"]
    assert {"name": "state", "persistentVolumeClaim": {"claimName": claim["metadata"]["name"]}} in pod["volumes"]
    assert "--standby" in pod["containers"][0]["args"]  # both: whichever finds the lease free serves
    both = "tcp://msd-coordinator-0.msd-coordinator:5555,tcp://msd-coordinator-1.msd-coordinator:5555"
    (deployment,) = _by_kind(objects, "Deployment")
    assert f"--coordinator={both}" in deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "replicas" not in deployment["spec"]  # the autoscaler owns it
    (pdb,) = _by_kind(objects, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]


def test_each_pod_mounts_only_its_own_roles_secret_key():
    objects = _render(VALUE_SETS["JobSet with worker sidecars, CURVE"])
    job = yaml.safe_load(_by_kind(objects, "ConfigMap")[0]["data"]["job.yaml"])
    assert job["security"] == {"curve": "/etc/msd/keys"}

    def secret_files(spec, volume="keys"):
        (keys,) = [v for v in spec["volumes"] if v["name"] == volume]
        return {i["path"] for i in keys["secret"]["items"]}

    (sts,) = _by_kind(objects, "StatefulSet")
    (jobset,) = _by_kind(objects, "JobSet")
    trainer_pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    coordinator = secret_files(sts["spec"]["template"]["spec"])
    assert {f for f in coordinator if f.endswith("key_secret")} == {"coordinator.key_secret"}
    assert {"authorized/worker.key", "authorized/trainer.key", "authorized/operator.key"} <= coordinator
    assert {f for f in secret_files(trainer_pod) if f.endswith("key_secret")} == {"trainer.key_secret"}
    sidecars = {c["name"]: c for c in trainer_pod["initContainers"]}
    # the worker sidecar of a trainer pod has a volume of its own: the worker role's keys
    (mount,) = [m for m in sidecars["msd-worker"]["volumeMounts"] if m["mountPath"] == "/etc/msd/keys"]
    assert {f for f in secret_files(trainer_pod, mount["name"]) if f.endswith("key_secret")} == {"worker.key_secret"}
    (mount,) = [m for m in sidecars["msd-relay"]["volumeMounts"] if m["mountPath"] == "/etc/msd/keys"]
    assert mount["name"] == "keys"
    assert set(sidecars) == {"msd-relay", "msd-worker"}
    assert all(c["restartPolicy"] == "Always" for c in sidecars.values())  # native sidecars
    (trainer,) = trainer_pod["containers"]
    assert not any(m["name"] == "keys" for m in trainer["volumeMounts"])  # ranks speak ipc to their relay
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert env["MSD_RELAY"] == "ipc:///run/msd/relay.sock"
    assert env["MSD_COORDINATOR"] == "tcp://msd-coordinator-0.msd-coordinator:5555"
    relay_args = sidecars["msd-relay"]["args"]
    assert "--local=ipc:///run/msd/relay.sock" in relay_args and "--keys=/etc/msd/keys" in relay_args


def test_pytorchjob_has_a_master_and_workers_each_with_the_relay():
    objects = _render(VALUE_SETS["PyTorchJob, existing claim, S3 data"])
    (job,) = _by_kind(objects, "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] == 1 and specs["Worker"]["replicas"] == 2
    for spec in specs.values():
        pod = spec["template"]["spec"]
        assert [c["name"] for c in pod["containers"]] == ["pytorch"]  # the operator looks for this name
        assert [c["name"] for c in pod["initContainers"]] == ["msd-relay"]
    (sts,) = _by_kind(objects, "StatefulSet")
    pod = sts["spec"]["template"]["spec"]
    assert {"name": "state", "persistentVolumeClaim": {"claimName": "msd-state"}} in pod["volumes"]
    assert not _by_kind(objects, "PersistentVolumeClaim")
    assert not any(v["name"] == "data" for v in pod["volumes"])
    fixed = _render(VALUE_SETS["one trainer node, fixed worker processes"])
    assert list(_by_kind(fixed, "PyTorchJob")[0]["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    args = _by_kind(fixed, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--procs=3" in args and not any(a.startswith("--max-procs") for a in args)  # msd worker refuses both


def test_monitors_select_what_serves_metrics():
    objects = _render(VALUE_SETS["standby, autoscaled, monitored, CURVE"])
    (monitor,) = _by_kind(objects, "ServiceMonitor")
    (service,) = _by_kind(objects, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert {p["name"] for p in service["spec"]["ports"]} >= {e["port"] for e in monitor["spec"]["endpoints"]}
    (pods,) = _by_kind(objects, "PodMonitor")
    (deployment,) = _by_kind(objects, "Deployment")
    ports = {p["name"] for p in deployment["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {e["port"] for e in pods["spec"]["podMetricsEndpoints"]} <= ports
    dashboard = next(o for o in _by_kind(objects, "ConfigMap") if "msd-dashboard.json" in o["data"])
    assert json.loads(dashboard["data"]["msd-dashboard.json"])["panels"]
    (hpa,) = _by_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"] == "msd_workers_wanted"
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]


@pytest.mark.parametrize("values, where", [
    ({"workers": {"procs": "many"}}, "/workers/procs"),
    ({"coordinator": {"port": 70000}}, "/coordinator/port"),
    ({"trainer": {"kind": "slurm"}}, "/trainer/kind"),
    ({"trainer": {"kind": "jobset"}}, "/trainer/image"),  # a training job needs its image
    ({"coordinator": {"standbys": 2}}, "standbys"),  # a misspelt key is refused, not ignored
    ({"job": {"sources": {"web": {}}}}, "/job"),  # text, as written: a mapping would lose the sources' order
    ({"job": "seed: 1"}, "no sources"),
    ({"job": "sources: [web"}, "not a YAML mapping"),
    ({"data": {"mountPath": "data"}}, "/data/mountPath"),
])
def test_wrong_values_are_refused_naming_the_key(values, where):
    with pytest.raises((helm_python.HelmValuesError, helm_python.HelmRenderError)) as e:
        render_chart.render(values)
    assert where in str(e.value)


@pytest.mark.parametrize("values, where", [
    ("coordinator:\n  standbyy: true\n", "'standbyy' not allowed"),
    ("coordinator:\n  port: 99999\n", "/coordinator/port"),
    ("trainer:\n  kind: jobset\n", "trainer"),
])
def test_the_command_names_a_refused_key_without_a_traceback(values, where, tmp_path, capsys):
    """Tried as a new user would: the schema's errors came inside a Python traceback."""
    path = tmp_path / "values.yaml"
    path.write_text(values)
    assert render_chart.main(["--values", str(path), "--print"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("render_chart: the values are refused:") and where in err, err
    assert "Traceback" not in err


def test_deploy_kubernetes_is_the_charts_default_rendering():
    """CI fails here when the chart changed and `make k8s-manifests` was not run."""
    files = render_chart.manifests(render_chart.render(None))
    assert render_chart.differences(os.path.join(ROOT, "deploy", "kubernetes"), files) == []
    kustomization = yaml.safe_load(files["kustomization.yaml"])
    assert sorted(kustomization["resources"]) == sorted(n for n in files if n != "kustomization.yaml")


def test_chart_version_is_the_projects():
    chart = yaml.safe_load(open(os.path.join(render_chart.CHART, "Chart.yaml")))
    version = re.search(r'^version = "(.+)"', open(os.path.join(ROOT, "pyproject.toml")).read(), re.M).group(1)
    assert chart["version"] == chart["appVersion"] == version


def test_the_changelog_releases_the_projects_version_one_section_per_kind():
    """Issue 61: the chart said 0.3.0 while the CHANGELOG listed its features as Unreleased, with
    `### Added` three times and `### Changed` twice."""
    version = re.search(r'^version = "(.+)"', open(os.path.join(ROOT, "pyproject.toml")).read(), re.M).group(1)
    text = open(os.path.join(ROOT, "CHANGELOG.md")).read()
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - \d{4}-\d{2}-\d{2}$", text, re.M)
    assert releases and releases[0] == version, releases[:2]
    section = text.split(f"## [{version}]", 1)[1].split("\n## [", 1)[0]
    kinds = re.findall(r"^### (.+)$", section, re.M)
    assert len(kinds) == len(set(kinds)) and set(kinds) <= {"Added", "Changed", "Deprecated", "Removed", "Fixed",
                                                             "Security"}, kinds
    objects = render_chart.objects(render_chart.render(None))
    images = {c["image"] for o in objects for c in _containers(o)}
    assert images == {f"ghcr.io/megascale-data/msd:{version}"}, images


def _containers(obj: dict) -> list[dict]:
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if "template" in spec else {}
    return [*pod.get("containers", []), *pod.get("initContainers", [])]


def test_the_image_installs_with_the_script_ci_runs():
    """The Dockerfile and `make install` (what .ci/run's make test installs) run the same
    script; the image's final stage has no compiler and runs as a non-root user."""
    dockerfile = open(os.path.join(ROOT, "Dockerfile")).read()
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r"^RUN tools/install\.sh /opt/msd", dockerfile, re.M)
    assert re.search(r"^\t.*tools/install\.sh --editable \$\(VENV\)", makefile, re.M)
    final = dockerfile.rsplit("\nFROM ", 1)[1]
    assert "gcc" not in final and "apt-get" not in final
    user = re.search(r"^USER (\d+)", final, re.M)
    assert user and int(user.group(1)) != 0
    values = yaml.safe_load(open(os.path.join(render_chart.CHART, "values.yaml")))
    assert values["podSecurityContext"]["runAsUser"] == int(user.group(1))


def test_values_table_in_the_docs_is_generated_from_the_schema():
    page = open(os.path.join(ROOT, "docs", "how-to", "kubernetes.md")).read()
    assert chart_docs.table() in page, "run: python tools/chart_docs.py --write"
    schema = json.load(open(os.path.join(render_chart.CHART, "values.schema.json")))
    values = yaml.safe_load(open(os.path.join(render_chart.CHART, "values.yaml")))
    assert set(values) <= set(schema["properties"])
    for key in ("coordinator.standby", "workers.autoscaling.enabled", "security.curve.secretName"):
        assert f"`{key}`" in page


def test_the_job_text_is_passed_as_written():
    """Sources keep their order (it is their index; a mapping through Helm would sort them)."""
    mine = "sources:\n  web: {format: jsonl, paths: [/d/w.jsonl]}\n  code: {format: megatron, paths: [/d/c]}\n"
    objects = _render({"job": mine})
    assert next(o for o in objects if o["kind"] == "ConfigMap")["data"]["job.yaml"] == mine
    objects = _render({"job": mine, **KEYS})
    text = next(o for o in objects if o["kind"] == "ConfigMap")["data"]["job.yaml"]
    assert text == mine + "security:\n  curve: /etc/msd/keys\n"
    assert list(yaml.safe_load(text)["sources"]) == ["web", "code"]
    with pytest.raises(helm_python.HelmRenderError, match="leave security out"):
        render_chart.render({"job": mine + "security: {curve: /k}\n", **KEYS})


def test_a_values_file_wins_over_the_defaults(tmp_path):
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"coordinator": {"standby": True}}))
    rendered = render_chart.render(render_chart._merge({}, yaml.safe_load(path.read_text())))
    (sts,) = _by_kind(render_chart.objects(rendered), "StatefulSet")
    assert sts["spec"]["replicas"] == 2


@pytest.mark.parametrize("name", list(VALUE_SETS))
def test_helm_lint_strict_finds_nothing_to_warn_about(name):
    for kube in ("v1.30.0", "v1.34.0"):
        report = helm_python.lint(render_chart.CHART, VALUE_SETS[name], strict=True, kube_version=kube)
        assert not report["errors"], report
        assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


def test_render_chart_takes_the_job_file_as_helm_set_file_does(tmp_path, capsys):
    """docs/how-to/kubernetes.md: `--set-file job=job.yaml` named a file that did not exist, and
    render_chart could not be given a job file at all (issue 61)."""
    job = tmp_path / "job.yaml"
    job.write_text("seed: 7\nsources:\n  web: {format: jsonl, paths: [/data/web/*.jsonl]}\n")
    assert render_chart.main(["--set-file", f"job={job}", "--print"]) == 0
    rendered = [doc for doc in yaml.safe_load_all(capsys.readouterr().out) if doc]
    assert next(o for o in rendered if o["kind"] == "ConfigMap")["data"]["job.yaml"] == job.read_text()
    assert render_chart.main(["--set-file", f"job={tmp_path / 'missing.yaml'}", "--print"]) == 2
    assert "expected KEY=PATH of a file" in capsys.readouterr().err
