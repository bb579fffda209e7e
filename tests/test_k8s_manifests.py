"""deploy/k8s/ against Kubernetes' own schemas (kubernetes-validate, the test extra: the OpenAPI
schemas of a Kubernetes release, strict: a field the API does not have is an error), the
InferencePool against the Gateway API Inference Extension's v1 CRD (its required fields, here),
and what the manifests must agree on with imp: probes on /ready and /health, a grace period that
covers the preStop pause and --shutdown-timeout, an HPA on a gauge imp exports, the endpoint
picker's metric names on /metrics."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate (the test extra) is not installed")

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
VERSION = "1.30.0"  # the oldest release with the preStop `sleep` action on by default


def _docs():
    return [(p.name, d) for p in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text()) if d]


def test_builtin_kinds_validate_strictly():
    seen = set()
    for name, doc in _docs():
        if doc["apiVersion"].startswith("inference.networking"):
            continue
        kv.validate(doc, VERSION, strict=True)  # raises ValidationError naming the path
        seen.add(doc["kind"])
    assert {"Deployment", "Service", "HorizontalPodAutoscaler"} <= seen


# the v1 CRD's required fields and shapes (config/crd/bases/inference.networking.k8s.io_inferencepools.yaml)
POOL = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"}, "kind": {"const": "InferencePool"},
        "spec": {"type": "object", "required": ["selector", "targetPorts", "endpointPickerRef"],
                 "additionalProperties": False, "properties": {
                     "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                                  "properties": {"matchLabels": {"type": "object",
                                                                 "additionalProperties": {"type": "string"}}}},
                     "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": {
                         "type": "object", "required": ["number"], "additionalProperties": False,
                         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}},
                     "endpointPickerRef": {"type": "object", "required": ["name"], "additionalProperties": False,
                                           "properties": {
                                               "name": {"type": "string", "minLength": 1},
                                               "group": {"type": "string"}, "kind": {"type": "string"},
                                               "failureMode": {"enum": ["FailOpen", "FailClose"]},
                                               "port": {"type": "object", "required": ["number"],
                                                        "properties": {"number": {"type": "integer"}}}}}}}},
}


def test_inference_pool_matches_the_crd_and_the_deployment():
    import jsonschema

    pools = [d for _, d in _docs() if d["kind"] == "InferencePool"]
    assert len(pools) == 1
    jsonschema.validate(pools[0], POOL)
    deployment = next(d for n, d in _docs() if n == "deployment.yaml")
    assert pools[0]["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"][
        "labels"].items()


def _arg(args: list[str], flag: str, default: str) -> str:
    return args[args.index(flag) + 1] if flag in args else default


@pytest.mark.parametrize("name", ["deployment.yaml", "deployment-gpu.yaml"])
def test_deployment_agrees_with_imp(name):
    from imp.config import ServerConfig

    d = next(doc for n, doc in _docs() if n == name)
    pod = d["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    # the pod is killed only after the preStop pause and imp's whole drain
    drain = float(_arg(c["args"], "--shutdown-timeout", str(ServerConfig().shutdown_timeout_s)))
    pause = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pause + drain + 5
    assert _arg(c["args"], "--host", "127.0.0.1") == "0.0.0.0"
    assert d["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    if "gpu" in name:
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and _arg(c["args"], "--device", "cpu") == "cuda:0"


def test_the_metrics_the_manifests_name_are_imps():
    """The HPA's metric and the endpoint picker's flags name gauges the metrics actor registers."""
    src = (Path(__file__).resolve().parent.parent / "imp" / "actors" / "metrics.py").read_text()
    hpa = next(d for n, d in _docs() if n == "hpa.yaml")
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    names |= set(re.findall(r"--[a-z-]+-metric=(\w+)", (K8S / "inferencepool.yaml").read_text()))
    assert len(names) == 4
    for n in names:
        assert f'"{n}"' in src, n
