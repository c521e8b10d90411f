"""deploy/kubernetes: generated without drift, and the sidecar built to run locked down."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import yaml

SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "generate.py"
_spec = importlib.util.spec_from_file_location("k8s_generate", SCRIPT)
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)
DIR = generate.HERE


def documents() -> dict[str, dict]:
    docs = [d for p in sorted(DIR.glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    return {d["kind"]: d for d in docs}


def test_committed_manifests_match_the_generator(tmp_path):
    written = generate.write(tmp_path)
    assert {p.name for p in written} == {p.name for p in DIR.glob("*.yaml")}
    for path in written:
        assert path.read_text() == (DIR / path.name).read_text(), f"{path.name} is stale: run `make generate`"


def test_exporter_is_a_locked_down_sidecar_of_vllm():
    spec = documents()["Deployment"]["spec"]["template"]["spec"]
    vllm, exporter = spec["containers"]
    assert vllm["name"] == "vllm" and "--enable-prefix-caching" in vllm["args"]
    security = exporter["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0 and security["readOnlyRootFilesystem"]
    assert security["capabilities"] == {"drop": ["ALL"]} and not security["allowPrivilegeEscalation"]
    assert exporter["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert exporter["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert exporter["resources"]["requests"] and exporter["resources"]["limits"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in exporter["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}
    args = " ".join(exporter["args"])
    assert "--gpu.source dcgm --gpu.dcgm-url http://nvidia-dcgm-exporter.gpu-operator:9400/metrics" in args
    assert "--gpu.pod $(POD_NAME) --gpu.namespace $(POD_NAMESPACE)" in args
    assert "--vllm.url=http://127.0.0.1:8000/metrics" in args


def test_service_monitor_scrapes_the_sidecar_through_the_service():
    docs = documents()
    selector = docs["ServiceMonitor"]["spec"]["selector"]["matchLabels"]
    assert selector.items() <= docs["Service"]["metadata"]["labels"].items()
    ports = {p["name"]: p for p in docs["Service"]["spec"]["ports"]}
    assert {e["port"] for e in docs["ServiceMonitor"]["spec"]["endpoints"]} <= set(ports)
    assert ports["metrics"]["port"] == 18090


def test_prometheus_rule_carries_every_rule_group(tmp_path):
    groups = [
        g for p in sorted(generate.RULES.glob("*.yaml")) for g in yaml.safe_load(p.read_text())["groups"]
    ]
    assert groups, "alerts/rules/*.yaml missing"
    assert documents()["PrometheusRule"]["spec"]["groups"] == groups
    assert generate.prometheus_rule(tmp_path) is None  # no rule files: no PrometheusRule
