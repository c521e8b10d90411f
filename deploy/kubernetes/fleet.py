"""The fleet view's manifests (`make generate` via generate.py): the aggregator of one vLLM pool.

examples/fleet-direct (small pools): a headless Service gives the aggregator every vLLM pod's IP
(DNS A records); a StatefulSet runs SHARDS aggregators, each keeping one hash range
(`--fleet.shard K/N`, K from the pod index) and reading every replica's KV events over ZMQ.
examples/fleet (on NATS JetStream): a 3-node JetStream StatefulSet, the sidecars publish their
replica's residency (`--fleet.publish`) and each shard reads only its ranges (`--fleet.source`).
Both: a Service and ServiceMonitor let Prometheus scrape every shard and sum them (docs/fleet.md).
"""

from __future__ import annotations

import re

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


def direct_source(vllm_port: int) -> list[str]:
    return [f"--discovery.dns=vllm-headless:{vllm_port}", f"--replica.kv-events-port={KV_EVENTS_PORT}"]


def aggregator(image: str, security: dict, source: list[str], env: list[dict] = ()) -> dict:
    shard = {
        "name": "SHARD",
        "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}},
    }
    return {
        "name": "aggregator",
        "image": image,
        "args": ["aggregate", *source, f"--fleet.shard=$(SHARD)/{SHARDS}", f"--web.listen-address=:{PORT}"],
        "env": [shard, *env],
        "ports": [{"name": "metrics", "containerPort": PORT}],
        "livenessProbe": {"httpGet": {"path": "/healthz", "port": "metrics"}, "periodSeconds": 20},
        "readinessProbe": {"httpGet": {"path": "/readyz", "port": "metrics"}, "periodSeconds": 10},
        "resources": {
            "requests": {"cpu": "250m", "memory": "256Mi"},
            "limits": {"cpu": "1", "memory": "1Gi"},
        },
        "securityContext": security,
    }


def stateful_set(container: dict) -> dict:
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
                "spec": {"containers": [container]},
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
    container = aggregator(image, security, direct_source(vllm_port))
    return [
        headless_service(pool_labels, vllm_port),
        stateful_set(container),
        service(),
        service_monitor(),
    ]


# --- on NATS JetStream (examples/fleet) -------------------------------------------------------------
NATS, NATS_NODES, NATS_IMAGE = "kvcache-nats", 3, "nats:2.10.22-alpine"  # the compose fleet profile's
NATS_LABELS = {"app.kubernetes.io/name": NATS, "app.kubernetes.io/component": "event-plane"}
NATS_PORTS = {"client": 4222, "cluster": 6222, "monitor": 8222}
POOL = "llama"  # a pool of deploy/nats/authorization.conf, shipped as is
USERS_SECRET = "kvcache-nats-users"  # made by hand: docs/fleet.md, "On Kubernetes"
PASSWORDS = {"sidecar": "SIDECAR_LLAMA_PASSWORD", "aggregator": "AGGREGATOR_LLAMA_PASSWORD"}


def nats_conf() -> str:
    """Three servers routed to each other by their stable StatefulSet names; JetStream on the
    claim each keeps across restarts; the users of authorization.conf (passwords: $VARIABLES)."""
    routes = "\n".join(f"    nats://{NATS}-{i}.{NATS}:{NATS_PORTS['cluster']}" for i in range(NATS_NODES))
    return (
        "server_name: $POD_NAME\n"
        f"listen: 0.0.0.0:{NATS_PORTS['client']}\n"
        f"http: 0.0.0.0:{NATS_PORTS['monitor']}\n"
        # the stream's default 8 GiB (--fleet.max-bytes) fits, on a 10Gi claim
        "jetstream {\n  store_dir: /data\n  max_file_store: 9G\n}\n"
        f"cluster {{\n  name: {NATS}\n  listen: 0.0.0.0:{NATS_PORTS['cluster']}\n"
        f"  routes: [\n{routes}\n  ]\n}}\n"
        "include authorization.conf\n"
    )


def _secret_env(name: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": USERS_SECRET, "key": name}}}


def nats_url(role: str) -> str:
    """nats-py reads user:password from the URL; the password comes from the Secret, URL-safe."""
    return f"nats://{role}-{POOL}:$(NATS_PASSWORD)@{NATS}:{NATS_PORTS['client']}"


def nats_password(role: str) -> dict:
    return {"name": "NATS_PASSWORD", "valueFrom": _secret_env(PASSWORDS[role])["valueFrom"]}


def sidecar_publish_args() -> list[str]:
    """What a sidecar adds to publish its replica (named $POD_NAME) to the pool."""
    return [f"--fleet.publish={nats_url('sidecar')}", f"--fleet.pool={POOL}"]


def nats_config_map(authorization: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": NATS, "labels": NATS_LABELS},
        "data": {"nats.conf": nats_conf(), "authorization.conf": authorization},
    }


def nats_service() -> dict:
    """Headless: each server's own DNS name for the routes, and every ready server for clients."""
    ports = [{"name": name, "port": port, "targetPort": name} for name, port in NATS_PORTS.items()]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": NATS, "labels": NATS_LABELS},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": NATS_LABELS,
            "ports": ports,
        },
    }


def nats_server(security: dict, variables: list[str]) -> dict:
    field = {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    return {
        "name": "nats",
        "image": NATS_IMAGE,
        "args": ["--config", "/etc/nats/nats.conf"],
        "env": [field, *(_secret_env(name) for name in variables)],
        "ports": [{"name": name, "containerPort": port} for name, port in NATS_PORTS.items()],
        "livenessProbe": {"httpGet": {"path": "/healthz?js-enabled-only=true", "port": "monitor"}},
        "readinessProbe": {"httpGet": {"path": "/healthz?js-server-only=true", "port": "monitor"}},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "2Gi"}},
        "securityContext": security,
        "volumeMounts": [
            {"name": "config", "mountPath": "/etc/nats", "readOnly": True},
            {"name": "data", "mountPath": "/data"},
        ],
    }


def nats_stateful_set(security: dict, variables: list[str]) -> dict:
    claim = {
        "metadata": {"name": "data"},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "10Gi"}}},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": NATS, "labels": NATS_LABELS},
        "spec": {
            "serviceName": NATS,
            "replicas": NATS_NODES,
            "podManagementPolicy": "Parallel",  # the routes form the cluster whichever starts first
            "selector": {"matchLabels": NATS_LABELS},
            "template": {
                "metadata": {"labels": NATS_LABELS},
                "spec": {
                    "securityContext": {"fsGroup": security["runAsGroup"]},
                    "containers": [nats_server(security, variables)],
                    "volumes": [{"name": "config", "configMap": {"name": NATS}}],
                },
            },
            "volumeClaimTemplates": [claim],
        },
    }


def nats_network_policy() -> dict:
    """Routes (6222) carry no credentials: only the NATS servers reach them; clients and
    monitoring (4222, 8222) from the namespace's pods, whose users authorization.conf checks."""

    def ports(*names: str) -> list[dict]:
        return [{"protocol": "TCP", "port": NATS_PORTS[name]} for name in names]

    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": NATS, "labels": NATS_LABELS},
        "spec": {
            "podSelector": {"matchLabels": NATS_LABELS},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": NATS_LABELS}}], "ports": ports("cluster")},
                {"from": [{"podSelector": {}}], "ports": ports("client", "monitor")},
            ],
        },
    }


def nats_documents(image: str, security: dict, authorization: str) -> list[dict]:
    source = [
        f"--fleet.source={nats_url('aggregator')}",
        f"--fleet.pool={POOL}",
        f"--fleet.stream-replicas={NATS_NODES}",  # the stream outlives a server's loss
    ]
    container = aggregator(image, security, source, [nats_password("aggregator")])
    return [
        nats_config_map(authorization),
        nats_service(),
        nats_stateful_set(security, re.findall(r"password: \$(\w+)", authorization)),
        nats_network_policy(),
        stateful_set(container),
        service(),
        service_monitor(),
    ]
