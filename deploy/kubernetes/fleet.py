"""The fleet view's manifests (`make generate` via generate.py): the aggregator of one vLLM pool.

A headless Service gives the aggregator every vLLM pod's IP (DNS A records); a StatefulSet runs
SHARDS aggregators, each keeping one hash range (`--fleet.shard K/N`, K from the pod index);
a Service and ServiceMonitor let Prometheus scrape every shard and sum them (docs/fleet.md).
"""

from __future__ import annotations

NAME = "kvcache-aggregator"
PORT, KV_EVENTS_PORT, SHARDS = 18091, 5557, 2  # 18091: beside serve's 18090, outside 9100-9999
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/component": "fleet-view"}


def headless_service(pool_labels: dict, vllm_port: int) -> dict:
    """Not for traffic: its DNS name resolves to every ready vLLM pod (clusterIP: None). Its own
    labels differ from the pool's so the pool's ServiceMonitor does not scrape vLLM twice."""
    ports = [
        {"name": "http", "port": vllm_port, "targetPort": vllm_port},
        {"name": "kv-events", "port": KV_EVENTS_PORT, "targetPort": KV_EVENTS_PORT},
    ]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": "vllm-headless",
            "labels": {**pool_labels, "app.kubernetes.io/component": "discovery"},
        },
        "spec": {"clusterIP": "None", "selector": pool_labels, "ports": ports},
    }


def aggregator(image: str, security: dict, vllm_port: int) -> dict:
    shard = {
        "name": "SHARD",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    }
    return {
        "name": "aggregator",
        "image": image,
        "args": [
            "aggregate",
            f"--discovery.dns=vllm-headless:{vllm_port}",
            f"--replica.kv-events-port={KV_EVENTS_PORT}",
            f"--fleet.shard=$(SHARD)/{SHARDS}",
            f"--web.listen-address=:{PORT}",
        ],
        "env": [shard],
        "ports": [{"name": "metrics", "containerPort": PORT}],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 20},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 10},
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "1Gi"},
        },
        "securityContext": security,
    }


def stateful_set(image: str, security: dict, vllm_port: int) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": NAME, "labels": LABELS},
        "spec": {
            "serviceName": NAME,
            "replicas": SHARDS,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {"containers": [aggregator(image, security, vllm_port)]},
            },
        },
    }


def service() -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NAME, "labels": LABELS},
        "spec": {"selector": LABELS, "ports": [{"name": "metrics", "port": PORT, "targetPort": "metrics"}]},
    }


def service_monitor() -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": NAME, "labels": LABELS},
        "spec": {"selector": {"matchLabels": LABELS}, "endpoints": [{"port": "metrics", "interval": "15s"}]},
    }


def documents(pool_labels: dict, image: str, security: dict, vllm_port: int) -> list[dict]:
    return [
        headless_service(pool_labels, vllm_port),
        stateful_set(image, security, vllm_port),
        service(),
        service_monitor(),
    ]
