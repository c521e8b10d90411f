"""Write the kustomize layout of vLLM with the exporter as a sidecar (`make generate`).

base/: Deployment (vLLM + sidecar), Service, ServiceMonitor and the PrometheusRule built from
alerts/rules/*.yaml. examples/: overlays on the base — podmonitor (a PodMonitor instead of the
ServiceMonitor), gpu-sidecar (NVML in the sidecar), dcgm (the node's dcgm-exporter through a
node-local Service), fleet (fleet.py: NATS JetStream, publishing sidecars and the aggregator's
shards) and fleet-direct (fleet.py: the aggregator reading the replicas directly). dashboards/:
the Grafana dashboards of dashboards/json as ConfigMaps labelled `grafana_dashboard: "1"`, for the
Grafana sidecar (kube-prometheus-stack, production-stack, llm-d). Edit these files, not the
output; `--release` sets the `release` label that kube-prometheus-stack's monitor and rule
selectors match.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
RULES = HERE.parents[1] / "alerts" / "rules"
DASHBOARDS = HERE.parents[1] / "dashboards" / "json"
NAME, PORT, VLLM_PORT = "vllm", 18090, 8000
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": "inference"}
RELEASE = "kube-prometheus-stack"
# Prometheus job names, as in deploy/prometheus/prometheus.yml (alerts/config.yaml's exporter_job matches
# the first).
EXPORTER_JOB, VLLM_JOB = "kvcache-exporter", "vllm"
EXPORTER_IMAGE = "kvcache-exporter:0.1.0"
VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
# What the exporter reads besides the KV events (README "Try it on a real vLLM"; test_vllm_flags.py)
VLLM_FLAGS = (
    "--enable-prefix-caching",
    "--kv-cache-metrics",
    "--kv-cache-metrics-sample=1.0",
    "--enable-prompt-tokens-details",
)
DCGM_NAMESPACE, DCGM_APP, DCGM_PORT = "gpu-operator", "nvidia-dcgm-exporter", 9400
DCGM_LOCAL = "nvidia-dcgm-exporter-node-local"
LOCKED_DOWN = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _probe(path: str, period: int) -> dict:
    return {"httpGet": {"path": path, "port": "metrics"}, "periodSeconds": period, "timeoutSeconds": 3}


def exporter_args(*gpu: str) -> list[str]:
    return [
        "serve",
        f"--vllm.url=http://127.0.0.1:{VLLM_PORT}/metrics",
        "--kv-events.endpoint=tcp://127.0.0.1:5557",
        "--kv-events.mode=connect",
        *gpu,
    ]


def exporter() -> dict:
    return {
        "name": "kvcache-exporter",
        "image": EXPORTER_IMAGE,
        "args": exporter_args("--gpu.source=none"),
        "env": [_field_env("POD_NAME", "metadata.name"), _field_env("POD_NAMESPACE", "metadata.namespace")],
        "ports": [{"name": "metrics", "containerPort": PORT}],
        "livenessProbe": _probe("/healthz", 20),  # both stay open when basic auth is on
        "readinessProbe": _probe("/readyz", 10),
        "resources": {
            "requests": {"cpu": "50m", "memory": "64Mi"},
            "limits": {"cpu": "500m", "memory": "256Mi"},
        },
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 10001,
            "runAsGroup": 10001,
            "readOnlyRootFilesystem": True,
            **LOCKED_DOWN,
        },
    }


def vllm() -> dict:
    events = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}'
    return {
        "name": "vllm",
        "image": VLLM_IMAGE,
        "args": [f"--model={MODEL}", *VLLM_FLAGS, f"--kv-events-config={events}"],
        "ports": [{"name": "http", "containerPort": VLLM_PORT}],
        "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        "resources": {
            "requests": {"cpu": "2", "memory": "8Gi", "nvidia.com/gpu": 1},
            "limits": {"memory": "16Gi", "nvidia.com/gpu": 1},
        },
        # The official image runs as root and writes its model and compile caches under /root.
        "securityContext": LOCKED_DOWN,
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],
    }


def deployment() -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": NAME, "labels": LABELS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [vllm(), exporter()],
                    "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}],
                },
            },
        },
    }


def service() -> dict:
    ports = [{"name": "http", "port": VLLM_PORT, "targetPort": "http"}]
    ports.append({"name": "metrics", "port": PORT, "targetPort": "metrics"})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NAME, "labels": LABELS},
        "spec": {"selector": LABELS, "ports": ports},
    }


def _endpoints() -> list[dict]:
    """The exporter and vLLM each as a job of its own (the operator would name both after the Service)."""
    job = [{"action": "replace", "targetLabel": "job", "replacement": EXPORTER_JOB}]
    vllm_job = [{"action": "replace", "targetLabel": "job", "replacement": VLLM_JOB}]
    return [
        {"port": "metrics", "interval": "15s", "relabelings": job},
        {"port": "http", "path": "/metrics", "interval": "15s", "relabelings": vllm_job},
    ]


def _monitoring_meta(release: str, name: str = NAME) -> dict:
    return {"name": name, "labels": {**LABELS, "release": release}}


def service_monitor(release: str) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": _monitoring_meta(release),
        "spec": {"selector": {"matchLabels": LABELS}, "endpoints": _endpoints()},
    }


def pod_monitor(release: str) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": _monitoring_meta(release),
        "spec": {"selector": {"matchLabels": LABELS}, "podMetricsEndpoints": _endpoints()},
    }


def prometheus_rule(release: str, rules_dir: Path = RULES) -> dict | None:
    groups = [g for p in sorted(rules_dir.glob("*.yaml")) for g in yaml.safe_load(p.read_text())["groups"]]
    if not groups:
        return None
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": _monitoring_meta(release, "kvcache-exporter"),
        "spec": {"groups": groups},
    }


class _Literal(str):
    """Written as a YAML block (|), so a dashboard reads as the JSON it is."""


def dashboard_config_maps(dashboards_dir: Path = DASHBOARDS) -> list[dict]:
    """One ConfigMap per dashboard; the Grafana sidecar loads every ConfigMap with this label."""
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": f"grafana-dashboard-{path.stem}",
                "labels": {"app.kubernetes.io/name": "kvcache-exporter", "grafana_dashboard": "1"},
            },
            "data": {path.name: _Literal(path.read_text())},
        }
        for path in sorted(dashboards_dir.glob("*.json"))
    ]


def dcgm_node_local_service() -> dict:
    """dcgm-exporter's pods behind a Service that answers only from the caller's node."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": DCGM_LOCAL, "namespace": DCGM_NAMESPACE},
        "spec": {
            "selector": {"app": DCGM_APP},
            "internalTrafficPolicy": "Local",
            "ports": [{"name": "metrics", "port": DCGM_PORT, "targetPort": DCGM_PORT}],
        },
    }


def exporter_patch(*gpu: str, env: list[dict] | None = None) -> dict:
    container = {"name": "kvcache-exporter", "args": exporter_args(*gpu)}
    if env:
        container["env"] = env
    spec = {"template": {"spec": {"containers": [container]}}}
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": NAME}, "spec": spec}


DCGM_URL = f"http://{DCGM_LOCAL}.{DCGM_NAMESPACE}:{DCGM_PORT}/metrics"
GPU_SIDECAR_ENV = [  # the NVIDIA runtime shows the node's GPUs to the sidecar, read-only NVML only
    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
    {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "utility"},
]


def _fleet():
    """fleet.py, loaded by path: this script runs both as a file and imported by tests."""
    spec = importlib.util.spec_from_file_location("k8s_fleet", HERE / "fleet.py")
    fleet = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fleet)
    return fleet


def _released(docs: list[dict], release: str) -> list[dict]:
    for doc in docs:
        if doc["kind"] in ("ServiceMonitor", "PodMonitor"):
            doc["metadata"]["labels"] = {**doc["metadata"]["labels"], "release": release}
    return docs


def fleet_documents(release: str) -> list[dict]:
    docs = _fleet().documents(LABELS, EXPORTER_IMAGE, exporter()["securityContext"], VLLM_PORT)
    return _released(docs, release)


def fleet_nats_documents(release: str) -> list[dict]:
    """The NATS servers and the shards reading them (deploy/nats/authorization.conf as shipped)."""
    authorization = (HERE.parent / "nats" / "authorization.conf").read_text()
    docs = _fleet().nats_documents(EXPORTER_IMAGE, exporter()["securityContext"], authorization)
    for doc in docs:
        if doc["kind"] == "ConfigMap":
            doc["data"] = {name: _Literal(text) for name, text in doc["data"].items()}
    return _released(docs, release)


def fleet_publish_patch() -> dict:
    fleet = _fleet()
    env = [*exporter()["env"], fleet.nats_password("sidecar")]
    return exporter_patch("--gpu.source=none", *fleet.sidecar_publish_args(), env=env)


def kustomization(resources: list[str], patches: list[str] = ()) -> dict:
    out = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": resources}
    if patches:
        out["patches"] = [{"path": p} for p in patches]
    return out


def layout(release: str = RELEASE) -> dict[str, list[dict]]:
    """Relative path -> the documents of that file."""
    base = {
        "base/deployment.yaml": [deployment()],
        "base/service.yaml": [service()],
        "base/servicemonitor.yaml": [service_monitor(release)],
    }
    rule = prometheus_rule(release)
    if rule:
        base["base/prometheusrule.yaml"] = [rule]
    base["base/kustomization.yaml"] = [kustomization(sorted(Path(p).name for p in base))]
    drop_monitor = {"$patch": "delete", **{k: service_monitor(release)[k] for k in ("apiVersion", "kind")}}
    drop_monitor["metadata"] = {"name": NAME}
    return base | {
        "examples/podmonitor/podmonitor.yaml": [pod_monitor(release)],
        "examples/podmonitor/drop-servicemonitor.yaml": [drop_monitor],
        "examples/podmonitor/kustomization.yaml": [
            kustomization(["../../base", "podmonitor.yaml"], ["drop-servicemonitor.yaml"])
        ],
        "examples/gpu-sidecar/exporter-nvml.yaml": [
            exporter_patch("--gpu.source=nvml", env=[*exporter()["env"], *GPU_SIDECAR_ENV])
        ],
        "examples/gpu-sidecar/kustomization.yaml": [kustomization(["../../base"], ["exporter-nvml.yaml"])],
        "examples/dcgm/dcgm-exporter-node-local.yaml": [dcgm_node_local_service()],
        "examples/dcgm/exporter-dcgm.yaml": [
            exporter_patch("--gpu.source=dcgm", f"--gpu.dcgm-url={DCGM_URL}")
        ],
        "examples/dcgm/kustomization.yaml": [
            kustomization(["../../base", "dcgm-exporter-node-local.yaml"], ["exporter-dcgm.yaml"])
        ],
        "examples/fleet-direct/aggregator.yaml": fleet_documents(release),
        "examples/fleet-direct/kustomization.yaml": [kustomization(["../../base", "aggregator.yaml"])],
        "examples/fleet/nats.yaml": fleet_nats_documents(release)[:4],
        "examples/fleet/aggregator.yaml": fleet_nats_documents(release)[4:],
        "examples/fleet/exporter-publish.yaml": [fleet_publish_patch()],
        "examples/fleet/kustomization.yaml": [
            kustomization(["../../base", "nats.yaml", "aggregator.yaml"], ["exporter-publish.yaml"])
        ],
        "dashboards/dashboards.yaml": dashboard_config_maps(),
        "dashboards/kustomization.yaml": [kustomization(["dashboards.yaml"])],
    }


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:  # the label set repeats: write it out, not as &id001
        return True


_Dumper.add_representer(_Literal, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s, style="|"))


def _dump(documents: list[dict]) -> str:
    header = "# Generated by deploy/kubernetes/generate.py (`make generate`): edit that, not this.\n"
    body = yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=110)
    return header + body


def write(out: Path = HERE, release: str = RELEASE) -> list[Path]:
    written = []
    for name, documents in layout(release).items():
        path = out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(_dump(documents))
        written.append(path)
    return written


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--out", type=Path, default=HERE)
    parser.add_argument("--release", default=RELEASE, help="kube-prometheus-stack's Helm release name")
    args = parser.parse_args()
    for path in write(args.out, args.release):
        print(path)


if __name__ == "__main__":
    main()
