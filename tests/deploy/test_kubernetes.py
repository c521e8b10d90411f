"""deploy/kubernetes: generated without drift, rendered by kustomize, valid against Kubernetes' and
prometheus-operator's schemas, and wired so the project's rules find the exporter."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from kvcache_exporter.web.app import AUTH_EXEMPT
from tests.deploy import operator_schema

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "kubernetes" / "generate.py"
_spec = importlib.util.spec_from_file_location("k8s_generate", SCRIPT)
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)
DIR = generate.HERE
OVERLAYS = [
    "base",
    "examples/podmonitor",
    "examples/gpu-sidecar",
    "examples/dcgm",
    "examples/fleet",
    "examples/fleet-direct",
]
# The oldest Kubernetes kubernetes-validate still ships schemas for, and the newest.
KUBERNETES_VERSIONS = ["1.25.0", "1.37.0"]
MONITORS = ("ServiceMonitor", "PodMonitor")


def render(overlay: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl (kustomize) missing: the layout is checked file by file only")
    cmd = [kubectl, "kustomize", str(DIR / overlay)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(yaml.safe_load_all(done.stdout))


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: render(overlay) for overlay in OVERLAYS}


def by_kind(docs: list[dict]) -> dict[str, dict]:
    return {d["kind"]: d for d in docs if d["kind"] != "Service" or d["metadata"]["name"] == "vllm"}


def sidecar(docs: list[dict]) -> dict:
    containers = by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "kvcache-exporter")


def test_committed_layout_matches_the_generator(tmp_path):
    written = {p.relative_to(tmp_path) for p in generate.write(tmp_path)}
    committed = {p.relative_to(DIR) for p in DIR.rglob("*.yaml")}
    assert written == committed
    for path in written:
        stale = f"{path} is stale: run `make generate`"
        assert (tmp_path / path).read_text() == (DIR / path).read_text(), stale


def test_every_object_validates_strictly_against_kubernetes_schemas(rendered):
    objects = [
        d for docs in rendered.values() for d in docs if d["kind"] not in (*MONITORS, "PrometheusRule")
    ]
    assert {d["kind"] for d in objects} == {
        "ConfigMap",
        "Deployment",
        "NetworkPolicy",
        "Service",
        "StatefulSet",
    }
    for version in KUBERNETES_VERSIONS:
        for obj in objects:
            kubernetes_validate.validate(obj, version, strict=True)


def test_kubernetes_validation_rejects_a_typo(rendered):
    deployment = copy.deepcopy(by_kind(rendered["base"])["Deployment"])
    deployment["spec"]["replica"] = deployment["spec"].pop("replicas")
    with pytest.raises(kubernetes_validate.ValidationError, match="replica"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_monitors_and_rules_validate_against_the_operator_schemas(rendered):
    objects = [d for docs in rendered.values() for d in docs if d["kind"] in operator_schema.MODELS]
    assert {d["kind"] for d in objects} == {*MONITORS, "PrometheusRule"}
    for obj in objects:
        assert operator_schema.errors(obj) == [], obj["kind"]


@pytest.mark.parametrize("kind", MONITORS)
def test_operator_schema_rejects_a_typo(rendered, kind):
    monitor = copy.deepcopy(next(d for docs in rendered.values() for d in docs if d["kind"] == kind))
    endpoint = next(iter(v for k, v in monitor["spec"].items() if k.endswith("ndpoints")))[0]
    endpoint["intervall"] = endpoint.pop("interval")
    assert operator_schema.errors(monitor) == [f"spec.{_endpoints_key(kind)}.0.intervall: unknown field"]
    endpoint["interval"] = "15 s"
    assert any("interval: String should match pattern" in e for e in operator_schema.errors(monitor))


def _endpoints_key(kind: str) -> str:
    return "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"


def pool_monitors(rendered) -> list[dict]:
    """The monitors of vLLM and its sidecar (examples/fleet adds the aggregator's)."""
    return [
        d
        for docs in rendered.values()
        for d in docs
        if d["kind"] in MONITORS and d["metadata"]["name"] == "vllm"
    ]


def jobs(monitor: dict) -> dict[str, str]:
    """port -> the `job` label the operator's scrape config gives its targets."""
    out = {}
    for endpoint in monitor["spec"][_endpoints_key(monitor["kind"])]:
        rules = [r for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
        assert [r["action"] for r in rules] == ["replace"], endpoint
        out[endpoint["port"]] = rules[-1]["replacement"]
    return out


def test_the_exporter_is_the_job_the_rules_look_for(rendered):
    config = yaml.safe_load((ROOT / "alerts" / "config.yaml").read_text())
    exporter_job = re.compile(config["exporter_job"])
    rules = (ROOT / "alerts" / "rules" / "alerts.yaml").read_text()
    assert f'up{{job=~"{config["exporter_job"]}"}}' in rules
    monitors = pool_monitors(rendered)
    assert {m["kind"] for m in monitors} == set(MONITORS)
    for monitor in monitors:
        job = jobs(monitor)
        assert exporter_job.fullmatch(job["metrics"]), job
        assert not exporter_job.fullmatch(job["http"]), job  # vLLM's own up must not count as the exporter's
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    compose_jobs = {j["job_name"] for j in prometheus["scrape_configs"]}
    assert {generate.EXPORTER_JOB, generate.VLLM_JOB} <= compose_jobs  # the same names in compose
    fleet = [d for d in rendered["examples/fleet"] if d["kind"] == "ServiceMonitor"]
    (aggregator,) = [d for d in fleet if d["metadata"]["name"] != "vllm"]
    assert "relabelings" not in aggregator["spec"]["endpoints"][0]  # its job: the Service's name
    assert not exporter_job.fullmatch(aggregator["metadata"]["name"])


def test_monitors_select_the_service_or_pods_and_carry_the_release_label(rendered):
    for overlay, docs in rendered.items():
        kinds = by_kind(docs)
        (monitor,) = [d for d in docs if d["kind"] in MONITORS and d["metadata"]["name"] == "vllm"]
        assert (monitor["kind"] == "PodMonitor") == (overlay == "examples/podmonitor")
        target = (
            kinds["Service"]
            if monitor["kind"] == "ServiceMonitor"
            else kinds["Deployment"]["spec"]["template"]
        )
        assert monitor["spec"]["selector"]["matchLabels"].items() <= target["metadata"]["labels"].items()
        ports = {p["name"] for p in kinds["Service"]["spec"]["ports"]}
        assert set(jobs(monitor)) == ports == {"metrics", "http"}
        for obj in (monitor, kinds["PrometheusRule"]):
            assert obj["metadata"]["labels"]["release"] == generate.RELEASE


def test_release_label_is_configurable():
    assert generate.service_monitor("prom")["metadata"]["labels"]["release"] == "prom"
    assert generate.pod_monitor("prom")["metadata"]["labels"]["release"] == "prom"
    assert generate.prometheus_rule("prom")["metadata"]["labels"]["release"] == "prom"


def test_exporter_is_a_locked_down_sidecar_whose_probes_need_no_credentials(rendered):
    exporter = sidecar(rendered["base"])
    security = exporter["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0 and security["readOnlyRootFilesystem"]
    assert security["capabilities"] == {"drop": ["ALL"]} and not security["allowPrivilegeEscalation"]
    probes = {exporter["livenessProbe"]["httpGet"]["path"], exporter["readinessProbe"]["httpGet"]["path"]}
    assert probes == {"/healthz", "/readyz"} and probes <= AUTH_EXEMPT
    assert exporter["resources"]["requests"] and exporter["resources"]["limits"]
    assert "--vllm.url=http://127.0.0.1:8000/metrics" in exporter["args"]
    assert "--gpu.source=none" in exporter["args"]


def test_vllm_has_a_security_context_and_requests(rendered):
    pod = by_kind(rendered["base"])["Deployment"]["spec"]["template"]["spec"]
    vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
    assert "--enable-prefix-caching" in vllm["args"]
    assert vllm["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert {"cpu", "memory", "nvidia.com/gpu"} <= set(vllm["resources"]["requests"])
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == vllm["resources"]["requests"]["nvidia.com/gpu"]


def test_dcgm_example_reads_the_dcgm_exporter_of_its_own_node(rendered):
    docs = rendered["examples/dcgm"]
    (local,) = [d for d in docs if d["kind"] == "Service" and d["metadata"]["name"] != "vllm"]
    assert local["spec"]["internalTrafficPolicy"] == "Local"
    host = f"{local['metadata']['name']}.{local['metadata']['namespace']}:{local['spec']['ports'][0]['port']}"
    args = sidecar(docs)["args"]
    assert "--gpu.source=dcgm" in args and f"--gpu.dcgm-url=http://{host}/metrics" in args
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in sidecar(docs)["env"]}
    assert env == {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"}  # --gpu.pod defaults


def test_gpu_sidecar_example_reads_nvml(rendered):
    exporter = sidecar(rendered["examples/gpu-sidecar"])
    assert "--gpu.source=nvml" in exporter["args"]
    env = {e["name"]: e.get("value") for e in exporter["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "POD_NAME" in env  # the patch keeps the base's downward-API variables


def test_prometheus_rule_carries_every_rule_group(tmp_path):
    groups = [
        g for p in sorted(generate.RULES.glob("*.yaml")) for g in yaml.safe_load(p.read_text())["groups"]
    ]
    assert groups, "alerts/rules/*.yaml missing"
    rule = yaml.safe_load((DIR / "base" / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == groups
    assert generate.prometheus_rule(generate.RELEASE, tmp_path) is None  # no rule files: no PrometheusRule


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_sidecars_arguments_pass_the_exporters_own_check(rendered, overlay):
    exporter = sidecar(rendered[overlay])
    env = {e["name"]: "x" for e in exporter["env"]}  # the downward API fills these in the pod
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in exporter["args"]]
    cmd = [sys.executable, "-m", "kvcache_exporter", *args, "--check-config"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **env})
    assert done.returncode == 0 and "configuration OK" in done.stdout, done.stderr


def test_dashboards_ship_as_config_maps_the_grafana_sidecar_loads():
    config_maps = render("dashboards")
    shipped = {path.name: path.read_text() for path in (ROOT / "dashboards" / "json").glob("*.json")}
    assert len(shipped) >= 3
    data = {}
    for config_map in config_maps:
        assert config_map["kind"] == "ConfigMap"
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(config_map, version, strict=True)
        # kubectl apply keeps a copy in an annotation limited to 256 KiB; a ConfigMap holds 1 MiB
        assert len(yaml.safe_dump(config_map)) < 256 * 1024, config_map["metadata"]["name"]
        data |= config_map["data"]
    assert data == shipped  # every dashboard, byte for byte
    assert {json.loads(text)["uid"] for text in data.values()} == {n.removesuffix(".json") for n in shipped}
