"""The rendered chart's pods as real processes on this machine, without a cluster: what a kubelet
and the cluster's DNS would do, as far as msd can tell.

- A pod is a network namespace on one bridge, with its own address. Its Service names (a headless
  Service's `POD.SERVICE`, as the namespace's search domain lets pods write them) resolve to the
  pods' addresses through the namespace's /etc/hosts (`ip netns exec` mounts /etc/netns/NS/hosts
  there), rewritten in place as pods come and go, as DNS would answer.
- A container is a process in that namespace, with the pod's name as its hostname (a UTS
  namespace), and a mount namespace of its own: each volume
  bind-mounted at its mountPath (ConfigMaps and Secrets written to folders, emptyDirs shared by
  the pod's containers, claims and hostPaths folders of the test), read-only where the manifest
  says so, then the root file system remounted read-only when its securityContext asks; it runs
  as the pod's user and group (setpriv), with only the manifest's environment (and the image's
  PATH) and its command and args with $(VAR) expanded as Kubernetes expands them.
- Native sidecars (init containers with restartPolicy Always) start first; probes are read from
  the manifest and asked over the bridge (`ready`).

Needs root, iproute2, util-linux (unshare, setpriv): the namespaces and mounts are the external
boundary; the processes, sockets and files are real.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

IMAGE_USER = 10001  # the Dockerfile's USER: a container that sets no runAsUser runs as it


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command, args and env values ($$ escapes)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


@dataclass
class Pod:
    name: str
    spec: dict[str, Any]
    labels: dict[str, str]
    annotations: dict[str, str]
    namespace: str = ""
    address: str = ""
    volumes: dict[str, str] = field(default_factory=dict)  # volume name -> folder here
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)  # container name -> process
    hostname: str = ""
    subdomain: str = ""

    def containers(self) -> list[dict[str, Any]]:
        sidecars = [c for c in self.spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        return sidecars + list(self.spec["containers"])


class Cluster:
    """Pods on one bridge. `objects`: the rendered manifests (for ConfigMaps, Services);
    `secrets`: name -> {key: bytes}; `claims`: PersistentVolumeClaim name -> folder; `image_path`:
    the image's PATH (its venv's bin first); volumes go under `work` (which the pods' user must
    be able to enter, outside /tmp), each container's output to `logs`."""

    def __init__(self, objects: list[dict[str, Any]], work: str, image_path: str, logs: str,
                 secrets: dict[str, dict[str, bytes]] | None = None, claims: dict[str, str] | None = None) -> None:
        self.objects, self.work, self.image_path, self.logs = objects, work, image_path, logs
        self.secrets, self.claims = secrets or {}, dict(claims or {})
        self.pods: dict[str, Pod] = {}
        tag = f"{os.getpid() % 10000}"
        self.octet = os.getpid() % 200 + 20
        self.bridge, self.near = f"msdkb{tag}", f"10.{self.octet}.99.1"
        self._tag, self._next = tag, 10
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.near}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    # ------------------------------------------------------------------ workloads

    def template(self, kind: str, name: str) -> dict[str, Any]:
        """The pod template of a rendered workload (a JobSet's first replicated job's)."""
        obj = next(o for o in self.objects if o["kind"] == kind and o["metadata"]["name"] == name)
        if kind == "JobSet":
            return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        return obj["spec"]["template"]

    def claim_templates(self, name: str) -> list[str]:
        obj = next(o for o in self.objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == name)
        return [t["metadata"]["name"] for t in obj["spec"].get("volumeClaimTemplates", [])]

    # ------------------------------------------------------------------ pods

    def start(self, name: str, template: dict[str, Any], *, hostname: str = "", subdomain: str = "",
              annotations: dict[str, str] | None = None, claims: dict[str, str] | None = None) -> Pod:
        """Create pod `name` from `template` (a fresh namespace and address) and start its
        containers. `claims`: this pod's claims from a StatefulSet's volumeClaimTemplates."""
        meta = template.get("metadata", {})
        pod = Pod(name, template["spec"], dict(meta.get("labels", {})),
                  {**meta.get("annotations", {}), **(annotations or {})}, hostname=hostname, subdomain=subdomain)
        i = self._next
        self._next += 1
        pod.namespace, pod.address = f"msdpod-{self._tag}-{i}", f"10.{self.octet}.99.{i}"
        here, there = f"msk{self._tag}h{i}", f"msk{self._tag}n{i}"
        _ip("netns", "add", pod.namespace)
        _ip("link", "add", here, "type", "veth", "peer", "name", there)
        _ip("link", "set", there, "netns", pod.namespace)
        _ip("link", "set", here, "master", self.bridge)
        _ip("link", "set", here, "up")
        _ip("-n", pod.namespace, "addr", "add", f"{pod.address}/24", "dev", there)
        _ip("-n", pod.namespace, "link", "set", there, "up")
        _ip("-n", pod.namespace, "link", "set", "lo", "up")
        self.pods[name] = pod
        self._volumes(pod, claims or {})
        self._resolve()
        for c in pod.containers():
            pod.processes[c["name"]] = self._run(pod, c)
        return pod

    def kill(self, name: str) -> None:
        """SIGKILL every container of the pod and remove it (a node lost, `kubectl delete --grace-period=0`)."""
        pod = self.pods.pop(name)
        for p in pod.processes.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in pod.processes.values():
            p.wait()
        subprocess.run(["ip", "netns", "del", pod.namespace], capture_output=True)
        shutil.rmtree(f"/etc/netns/{pod.namespace}", ignore_errors=True)
        self._resolve()

    def stop(self, name: str, grace_s: float = 20.0) -> None:
        """SIGTERM, then SIGKILL after the grace period (a pod deleted)."""
        pod = self.pods[name]
        for p in pod.processes.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for p in pod.processes.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill(name)

    def close(self) -> None:
        for name in list(self.pods):
            self.kill(name)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    # ------------------------------------------------------------------ probes

    def probe(self, pod_name: str, container: str, kind: str = "readinessProbe") -> tuple[bool, str]:
        """Ask a container's probe as the kubelet would (httpGet or tcpSocket on the pod's address)."""
        pod = self.pods[pod_name]
        spec = next(c for c in pod.containers() if c["name"] == container)
        probe = spec.get(kind) or {}
        ports = {p.get("name"): p["containerPort"] for p in spec.get("ports", [])}
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = ports.get(get["port"], get["port"])
            try:
                with urllib.request.urlopen(f"http://{pod.address}:{port}{get['path']}", timeout=3) as r:
                    return 200 <= r.status < 400, r.read().decode()
            except urllib.error.HTTPError as e:
                return False, e.read().decode()
            except OSError as e:
                return False, str(e)
        if "tcpSocket" in probe:
            port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
            try:
                socket.create_connection((pod.address, port), timeout=3).close()
                return True, "connected"
            except OSError as e:
                return False, str(e)
        raise AssertionError(f"{pod_name}/{container}: no {kind}")

    def wait_ready(self, pod_name: str, container: str, timeout_s: float = 60, kind: str = "readinessProbe") -> str:
        deadline = time.monotonic() + timeout_s
        while True:
            ok, body = self.probe(pod_name, container, kind)
            if ok:
                return body
            p = self.pods[pod_name].processes[container]
            if p.poll() is not None:
                raise AssertionError(f"{pod_name}/{container} exited with {p.returncode}; log: "
                                     f"{self.log(pod_name, container)[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{pod_name}/{container} not ready in {timeout_s}s: {body}")
            time.sleep(0.3)

    def log(self, pod_name: str, container: str) -> str:
        path = os.path.join(self.logs, f"{pod_name}.{container}.log")
        return open(path, errors="replace").read() if os.path.exists(path) else ""

    # ------------------------------------------------------------------ inside

    def _resolve(self) -> None:
        """Every pod's /etc/hosts: its own name, and each pod of a headless Service as POD.SERVICE
        (and the longer forms). Rewritten in place: the bind mount of a running pod sees it."""
        lines = ["127.0.0.1 localhost"]
        for svc in (o for o in self.objects if o["kind"] == "Service"):
            selector = svc["spec"].get("selector", {})
            for pod in self.pods.values():
                if selector and all(pod.labels.get(k) == v for k, v in selector.items()):
                    short = f"{pod.name}.{svc['metadata']['name']}"
                    lines.append(f"{pod.address} {short} {short}.default.svc {short}.default.svc.cluster.local")
        for pod in self.pods.values():
            if pod.hostname and pod.subdomain:
                lines.append(f"{pod.address} {pod.hostname}.{pod.subdomain}")
        text = "\n".join(lines) + "\n"
        for pod in self.pods.values():
            folder = f"/etc/netns/{pod.namespace}"
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, "hosts"), "w") as f:  # same inode: truncated and written
                f.write(text + f"{pod.address} {pod.name}\n")

    def _volumes(self, pod: Pod, claims: dict[str, str]) -> None:
        security = pod.spec.get("securityContext", {})
        group = security.get("fsGroup")
        for v in pod.spec.get("volumes", []):
            folder = os.path.join(self.work, "volumes", pod.name, v["name"])
            if "configMap" in v:
                cm = next(o for o in self.objects if o["kind"] == "ConfigMap"
                          and o["metadata"]["name"] == v["configMap"]["name"])
                self._write(folder, {k: d.encode() for k, d in cm.get("data", {}).items()}, v["configMap"], group)
            elif "secret" in v:
                self._write(folder, self.secrets[v["secret"]["secretName"]], v["secret"], group)
            elif "emptyDir" in v:
                os.makedirs(folder, exist_ok=True)
                self._own(folder, group, 0o2777 if group is None else 0o2770)
            elif "persistentVolumeClaim" in v:
                folder = claims.get(v["name"]) or self.claims[v["persistentVolumeClaim"]["claimName"]]
                self._own(folder, group, 0o2770 if group is not None else 0o2777)
            elif "hostPath" in v:
                folder = v["hostPath"]["path"]
            else:
                raise AssertionError(f"volume {v['name']}: a kind this emulation does not know: {v}")
            pod.volumes[v["name"]] = folder
        for name, folder in claims.items():  # a StatefulSet's claims from its templates
            pod.volumes.setdefault(name, folder)
            self._own(folder, group, 0o2770 if group is not None else 0o2777)

    @staticmethod
    def _own(folder: str, group: int | None, mode: int) -> None:
        os.makedirs(folder, exist_ok=True)
        if group is not None:
            for root, dirs, files in os.walk(folder):
                for n in [root, *(os.path.join(root, d) for d in dirs), *(os.path.join(root, f) for f in files)]:
                    os.chown(n, -1, group)
        os.chmod(folder, mode)

    @staticmethod
    def _write(folder: str, data: dict[str, bytes], source: dict[str, Any], group: int | None) -> None:
        """A ConfigMap or Secret volume: its keys (or its `items`, key -> path) as files."""
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        mode = source.get("defaultMode", 0o644)
        for item in items:
            if item["key"] not in data:
                raise AssertionError(f"key {item['key']} is not in {source}")
            path = os.path.join(folder, item["path"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data[item["key"]])
            os.chmod(path, item.get("mode", mode))
            if group is not None:
                os.chown(path, 0, group)
        os.makedirs(folder, exist_ok=True)
        for root, dirs, _ in os.walk(folder):
            os.chmod(root, 0o755)

    def _env(self, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
        env = {"PATH": self.image_path, "HOSTNAME": pod.name}
        for e in c.get("env", []):
            if "value" in e:
                env[e["name"]] = _expand(str(e["value"]), env)
                continue
            ref = e["valueFrom"]
            if "fieldRef" in ref:
                path = ref["fieldRef"]["fieldPath"]
                m = re.fullmatch(r"metadata\.annotations\['(.+)'\]", path)
                env[e["name"]] = {"status.podIP": pod.address, "metadata.name": pod.name}.get(path) or (
                    pod.annotations[m.group(1)] if m else "")
                if not env[e["name"]]:
                    raise AssertionError(f"fieldRef {path}: not known to this emulation")
            elif "configMapKeyRef" in ref or "secretKeyRef" in ref:
                raise AssertionError(f"env {e['name']}: key references are not used by the chart")
        return env

    def _run(self, pod: Pod, c: dict[str, Any]) -> subprocess.Popen:
        env = self._env(pod, c)
        argv = [_expand(a, env) for a in [*c.get("command", []), *c.get("args", [])]]
        pod_security = pod.spec.get("securityContext", {})
        security = {**pod_security, **c.get("securityContext", {})}
        uid = security.get("runAsUser", IMAGE_USER)
        gid = security.get("runAsGroup", uid)
        groups = [g for g in [pod_security.get("fsGroup")] if g is not None]
        if security.get("runAsNonRoot") and uid == 0:
            raise AssertionError(f"{pod.name}/{c['name']}: runAsNonRoot with user 0")
        steps = ["set -e", f"hostname {shlex.quote(pod.name)}"]  # a pod's hostname is its name
        mounts = sorted(c.get("volumeMounts", []), key=lambda m: m["mountPath"].count("/"))
        for m in mounts:
            source = pod.volumes[m["name"]]
            target = m["mountPath"]
            steps.append(f"mkdir -p {shlex.quote(target)} && mount --bind {shlex.quote(source)} {shlex.quote(target)}")
            if m.get("readOnly"):
                steps.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        if security.get("readOnlyRootFilesystem"):
            steps.append("mount -o remount,bind,ro /")
        drop = "--inh-caps=-all --bounding-set=-all" if "ALL" in security.get("capabilities", {}).get("drop",
                                                                                                      []) else ""
        nnp = "--no-new-privs" if security.get("allowPrivilegeEscalation") is False else ""
        group_flag = f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"
        steps.append(f"exec setpriv --reuid={uid} --regid={gid} {group_flag} {drop} {nnp} -- "
                     + " ".join(shlex.quote(a) for a in argv))
        script = "\n".join(steps)
        log = open(os.path.join(self.logs, f"{pod.name}.{c['name']}.log"), "ab")
        command = ["ip", "netns", "exec", pod.namespace, "unshare", "--mount", "--uts", "--propagation", "private",
                   "sh", "-c", script]
        return subprocess.Popen(command, env={**env, "PATH": f"{self.image_path}:/usr/sbin:/usr/bin:/sbin:/bin"},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def secret_from_files(folder: str) -> dict[str, bytes]:
    """What `kubectl create secret generic NAME --from-file=FOLDER` stores: each regular file of
    the folder (not its subfolders) under its name."""
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


