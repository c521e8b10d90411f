"""deploy/kubernetes/examples/fleet: the fleet view's objects fit the pool (base/) and the aggregate CLI."""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from kvcache_exporter.aggregator import cli

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def objects(folder: str) -> dict[tuple[str, str], dict]:
    docs = [d for p in sorted((MANIFESTS / folder).glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] != "Kustomization"}


def test_the_headless_service_finds_the_vllm_pods_without_a_second_scrape():
    pool, fleet = objects("base"), objects("examples/fleet")
    headless = fleet[("Service", "vllm-headless")]
    pods = pool[("Deployment", "vllm")]["spec"]["template"]["metadata"]["labels"]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["selector"] == pods
    scraped = pool[("ServiceMonitor", "vllm")]["spec"]["selector"]["matchLabels"]
    assert not scraped.items() <= headless["metadata"]["labels"].items()
    ports = {p["name"]: p["port"] for p in headless["spec"]["ports"]}
    vllm = pool[("Deployment", "vllm")]["spec"]["template"]["spec"]["containers"][0]
    assert '"endpoint": "tcp://*:5557"' in " ".join(
        vllm["args"]
    )  # vLLM binds: sidecar and aggregator connect
    assert ports["kv-events"] == 5557


def test_every_shard_runs_aggregate_with_arguments_it_accepts():
    fleet = objects("examples/fleet")
    sts = fleet[("StatefulSet", "kvcache-aggregator")]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    assert container["env"][0]["valueFrom"]["fieldRef"]["fieldPath"].endswith("pod-index']")
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    for shard in range(sts["spec"]["replicas"]):
        args = parser.parse_args([a.replace("$(SHARD)", str(shard)) for a in container["args"]])
        settings, (dns,) = cli.settings_from(args)
        assert settings.hash_range.shard == shard and settings.hash_range.shards == sts["spec"]["replicas"]
        assert (dns.host, dns.port, dns.kv_port) == ("vllm-headless", 8000, 5557)
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    monitor = fleet[("ServiceMonitor", "kvcache-aggregator")]
    service = fleet[("Service", "kvcache-aggregator")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"] == sts["spec"]["template"]["metadata"]["labels"]
