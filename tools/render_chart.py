"""Render the Helm chart (deploy/helm/msd) offline, and write or check deploy/kubernetes/.

    python tools/render_chart.py --out deploy/kubernetes          # what `make k8s-manifests` runs
    python tools/render_chart.py --check deploy/kubernetes        # exit 1 if it differs from the chart
    python tools/render_chart.py --values my-values.yaml --set-file job=job.yaml --print  # one release's

The renderer is Helm's own Go code (helm-python-sdk, pinned in pyproject's test extra): the same
templates, functions and values.schema.json check as `helm template`, without a helm binary or a
cluster. deploy/kubernetes/ is the chart rendered with its default values, one file per template,
with a kustomization.yaml for `kubectl apply -k`.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(ROOT, "deploy", "helm", "msd")
RELEASE = "msd"
HEADER = ("# Generated from deploy/helm/msd with its default values by `make k8s-manifests`; do not edit:\n"
          "# change the chart (or install it with your values) instead. CI fails when this differs.\n")


def render(values: dict[str, Any] | None = None, name: str = RELEASE, namespace: str = "default",
           chart: str = CHART) -> dict[str, str]:
    """Template file name -> rendered manifest (templates that render nothing left out; NOTES.txt
    too). Raises helm_python.HelmValuesError for values the schema refuses."""
    import helm_python

    rendered = helm_python.Chart.load(chart).render(values, name=name, namespace=namespace, is_install=True)
    out = {}
    for path, text in sorted(rendered.items()):
        base = os.path.basename(path)
        if base.endswith(".txt") or not any(doc for doc in yaml.safe_load_all(text)):
            continue
        out[base] = text.strip() + "\n"
    return out


def objects(rendered: dict[str, str]) -> list[dict[str, Any]]:
    """Every Kubernetes object of a rendering, in template order."""
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def manifests(rendered: dict[str, str]) -> dict[str, str]:
    """The files of deploy/kubernetes/: each template's output, and a kustomization listing them."""
    files = {name: HEADER + text for name, text in rendered.items()}
    files["kustomization.yaml"] = HEADER + yaml.safe_dump(
        {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": sorted(rendered)},
        sort_keys=False)
    return files


def differences(directory: str, files: dict[str, str]) -> list[str]:
    """What differs between `directory` and `files`: one line each."""
    out = []
    present = {n for n in os.listdir(directory) if n.endswith(".yaml")} if os.path.isdir(directory) else set()
    for name in sorted(present - files.keys()):
        out.append(f"{directory}/{name}: not rendered by the chart any more")
    for name, text in sorted(files.items()):
        path = os.path.join(directory, name)
        if name not in present:
            out.append(f"{path}: missing")
        elif open(path).read() != text:
            out.append(f"{path}: differs from the chart's rendering")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--values", action="append", default=[], help="A values file (repeatable; later ones win).")
    p.add_argument("--set-file", action="append", default=[], metavar="KEY=PATH",
                   help="A value read from a file, as helm's --set-file (job=job.yaml: the job file; repeatable).")
    p.add_argument("--name", default=RELEASE, help="Release name.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--out", help="Write the manifests into this directory (replacing its .yaml files).")
    what.add_argument("--check", help="Exit 1 if this directory differs from the chart's rendering.")
    what.add_argument("--print", action="store_true", help="Print the manifests.")
    args = p.parse_args(argv)
    values: dict[str, Any] = {}
    for path in args.values:
        with open(path) as f:
            values = _merge(values, yaml.safe_load(f) or {})
    for item in args.set_file:
        key, _, path = item.partition("=")
        if not key or not path or not os.path.isfile(path):
            print(f"render_chart: --set-file {item!r}: expected KEY=PATH of a file", file=sys.stderr)
            return 2
        with open(path) as f:
            values = _merge(values, _nested(key, f.read()))
    import helm_python

    try:
        rendered = render(values or None, name=args.name)
    except (helm_python.HelmValuesError, helm_python.HelmRenderError) as e:  # it names the key; a traceback hid it
        print(f"render_chart: the values are refused: {e}", file=sys.stderr)
        return 2
    if args.print:
        sys.stdout.write("---\n".join(rendered.values()))
        return 0
    files = manifests(rendered)
    if args.check:
        diff = differences(args.check, files)
        for line in diff:
            print(line, file=sys.stderr)
        if diff:
            print("run `make k8s-manifests` and commit the result", file=sys.stderr)
        return 1 if diff else 0
    os.makedirs(args.out, exist_ok=True)
    for name in os.listdir(args.out):
        if name.endswith(".yaml") and name not in files:
            os.remove(os.path.join(args.out, name))
    for name, text in files.items():
        with open(os.path.join(args.out, name), "w") as f:
            f.write(text)
    print(f"wrote {len(files)} files to {args.out}")
    return 0


def _nested(key: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for the key "a.b" (helm's dotted keys)."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


if __name__ == "__main__":
    sys.exit(main())
