"""Make the trimmed schemas of this folder from the operators' CRDs (run by hand when a CRD
version changes; the sources are named in each file's $comment):

    python tests/deploy/crds/trim.py CRD.yaml VERSION SOURCE > tests/deploy/crds/KIND.json

The pod templates inside (a JobSet's Jobs', a PyTorchJob's replicas') are replaced by a bare
object: test_chart.py validates them against the Kubernetes schemas of each version instead.
Descriptions go; every object schema with properties refuses unknown fields (as `kubectl apply
--validate=strict` does), unless the CRD lets it keep them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import yaml


def _is_pod_template(schema: dict[str, Any]) -> bool:
    spec = schema.get("properties", {}).get("spec", {})
    return "metadata" in schema.get("properties", {}) and "containers" in spec.get("properties", {})


def trim(schema: Any) -> Any:
    if isinstance(schema, list):
        return [trim(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    if _is_pod_template(schema):
        return {"type": "object", "x-msd": "a PodTemplateSpec: validated against the Kubernetes schemas"}
    out = {k: trim(v) for k, v in schema.items() if k != "description"}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def main() -> None:
    path, version, source = sys.argv[1:4]
    crd = yaml.safe_load(open(path))
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = trim(served["schema"]["openAPIV3Schema"])
    schema["$comment"] = f"{crd['spec']['group']}/{version} {crd['spec']['names']['kind']}, trimmed from {source}"
    json.dump(schema, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
