"""deploy/kubernetes/examples/fleet (on NATS JetStream) and fleet-direct: the fleet view's objects fit
the pool (base/), the aggregate CLI and, for NATS, a real nats-server's own configuration check."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from urllib.request import urlopen

import pytest
import yaml

from kvcache_exporter.aggregator import cli
from kvcache_exporter.config import AGGREGATE_OPTIONS, resolve_aggregate
from kvcache_exporter.fleet_publish import NatsOptions
from tests.aggregator.test_nats_security import reaches_a_shard
from tests.conftest import free_port

MANIFESTS = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


def objects(folder: str) -> dict[tuple[str, str], dict]:
    docs = [d for p in sorted((MANIFESTS / folder).glob("*.yaml")) for d in yaml.safe_load_all(p.read_text())]
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d["kind"] != "Kustomization"}


def test_the_headless_service_finds_the_vllm_pods_without_a_second_scrape():
    pool, fleet = objects("base"), objects("examples/fleet-direct")
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
    fleet = objects("examples/fleet-direct")
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


def nats_config(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The ConfigMap's files written out, and the environment the NATS container gives the server
    (its Secret's keys and POD_NAME; any value will do for the check)."""
    fleet = objects("examples/fleet")
    for name, text in fleet[("ConfigMap", "kvcache-nats")]["data"].items():
        (tmp_path / name).write_text(text)
    (container,) = fleet[("StatefulSet", "kvcache-nats")]["spec"]["template"]["spec"]["containers"]
    return tmp_path / "nats.conf", {e["name"]: f"x-{e['name']}" for e in container["env"]}


def nats_check(config: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    binary = shutil.which("nats-server")
    if binary is None:
        pytest.skip("nats-server is not installed (make system-deps installs it as root)")
    return subprocess.run(
        [binary, "-t", "-c", str(config)], capture_output=True, text=True, timeout=30, env=env
    )


def test_the_nats_configuration_passes_nats_servers_own_check(tmp_path):
    config, env = nats_config(tmp_path)
    done = nats_check(config, env)
    assert done.returncode == 0 and "is valid" in done.stdout + done.stderr, done.stderr
    assert "include authorization.conf" in config.read_text()
    shipped = MANIFESTS.parents[0] / "nats" / "authorization.conf"
    assert (tmp_path / "authorization.conf").read_text() == shipped.read_text()  # the pools as tested


def test_the_nats_check_fails_without_a_password_or_with_a_typo(tmp_path):
    config, env = nats_config(tmp_path)
    missing = {k: v for k, v in env.items() if k != "AGGREGATOR_MISTRAL_PASSWORD"}
    done = nats_check(config, missing)
    assert done.returncode != 0 and "AGGREGATOR_MISTRAL_PASSWORD" in done.stderr
    config.write_text(config.read_text().replace("jetstream {", "jetstream {{"))
    assert nats_check(config, env).returncode != 0


def test_three_jetstream_servers_route_to_each_other_and_keep_their_store():
    fleet = objects("examples/fleet")
    sts, service = fleet[("StatefulSet", "kvcache-nats")], fleet[("Service", "kvcache-nats")]
    conf = fleet[("ConfigMap", "kvcache-nats")]["data"]["nats.conf"]
    assert sts["spec"]["replicas"] == 3 and sts["spec"]["serviceName"] == service["metadata"]["name"]
    assert (
        service["spec"]["clusterIP"] == "None"
        and service["spec"]["selector"] == sts["spec"]["selector"]["matchLabels"]
    )
    cluster = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "cluster")
    routes = re.findall(r"nats://(\S+)", conf)
    assert routes == [f"kvcache-nats-{i}.kvcache-nats:{cluster}" for i in range(3)]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert f"store_dir: {mounts[claim['metadata']['name']]}\n" in conf
    assert container["args"] == ["--config", f"{mounts['config']}/nats.conf"]
    assert (
        container["securityContext"]["runAsNonRoot"]
        and container["securityContext"]["readOnlyRootFilesystem"]
    )
    policy = fleet[("NetworkPolicy", "kvcache-nats")]["spec"]
    assert policy["podSelector"] == sts["spec"]["selector"]
    (routes_from,) = [
        r["from"] for r in policy["ingress"] if {"protocol": "TCP", "port": cluster} in r["ports"]
    ]
    assert routes_from == [{"podSelector": sts["spec"]["selector"]}]  # routes carry no credentials


def user_and_pool(url: str) -> tuple[str, str]:
    user = re.fullmatch(r"nats://([\w-]+):\$\(NATS_PASSWORD\)@kvcache-nats:4222", url)
    assert user, url
    return user[1], user[1].split("-", 1)[1]


def secret_key(container: dict) -> str:
    (password,) = [e for e in container["env"] if e["name"] == "NATS_PASSWORD"]
    return password["valueFrom"]["secretKeyRef"]["key"]


def test_sidecars_publish_and_shards_read_their_pool_as_its_nats_users():
    fleet = objects("examples/fleet")
    authorization = fleet[("ConfigMap", "kvcache-nats")]["data"]["authorization.conf"]
    users = dict(re.findall(r"user: ([\w-]+), password: \$(\w+)", authorization))
    patch = fleet[("Deployment", "vllm")]["spec"]["template"]["spec"]["containers"][0]
    flags = dict(a.split("=", 1) for a in patch["args"] if "=" in a)
    user, pool = user_and_pool(flags["--fleet.publish"])
    assert user == f"sidecar-{pool}" and flags["--fleet.pool"] == pool and users[user] == secret_key(patch)
    assert f'"kvcache.{pool}.>"' in authorization  # the subjects the user may publish to are its pool's
    sts = fleet[("StatefulSet", "kvcache-aggregator")]
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    for shard in range(sts["spec"]["replicas"]):
        args = parser.parse_args([a.replace("$(SHARD)", str(shard)) for a in container["args"]])
        flags = {o.key: getattr(args, o.attr) for o in AGGREGATE_OPTIONS}
        settings = resolve_aggregate(flags, {}, args.config_file)
        assert settings.fleet_shard == f"{shard}/{sts['spec']['replicas']}"
        nats_servers = fleet[("StatefulSet", "kvcache-nats")]["spec"]["replicas"]
        assert settings.fleet_stream_replicas == nats_servers  # a copy of the stream on every server
        user, source_pool = user_and_pool(settings.fleet_source)
        assert (user, source_pool, settings.fleet_pool) == (f"aggregator-{pool}", pool, pool)
        assert cli.discoveries_from(settings) == []  # no /metrics polling: the sidecars publish the counters
    assert users[f"aggregator-{pool}"] == secret_key(container)


def cluster_on_loopback(tmp_path: Path) -> tuple[list[subprocess.Popen], list[int], list[int]]:
    """The ConfigMap's nats.conf run for real: three servers, names and addresses moved to loopback
    ports and a folder each, nothing else changed. Returns the processes, their client ports and their
    monitoring ports."""
    conf_path, env = nats_config(tmp_path)
    conf = conf_path.read_text()
    binary = shutil.which("nats-server")
    ports = [(free_port(), free_port(), free_port()) for _ in range(3)]
    routes = [f"nats://127.0.0.1:{cluster}" for _, cluster, _ in ports]
    processes = []
    for k, (client, cluster, monitor) in enumerate(ports):
        text = re.sub(r"nats://kvcache-nats-(\d)\.kvcache-nats:6222", lambda m: routes[int(m[1])], conf)
        text = text.replace("0.0.0.0:4222", f"127.0.0.1:{client}").replace(
            "0.0.0.0:8222", f"127.0.0.1:{monitor}"
        )
        text = text.replace("0.0.0.0:6222", f"127.0.0.1:{cluster}").replace("/data", str(tmp_path / f"js{k}"))
        assert text.count("127.0.0.1") == 6, text  # every address of the shipped config moved
        (tmp_path / f"nats-{k}.conf").write_text(text)
        server_env = {**os.environ, **env, "POD_NAME": f"kvcache-nats-{k}"}
        args = [binary, "-c", str(tmp_path / f"nats-{k}.conf")]
        processes.append(
            subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=server_env)
        )
    return processes, [client for client, _, _ in ports], [monitor for _, _, monitor in ports]


def meta_group_formed(monitor_ports: list[int], seconds: float) -> None:
    """Waits until every server names the same JetStream meta leader and the leader counts the other
    servers current: what a StatefulSet's rollout gives a shard before it comes (a shard started
    earlier only retries, tested in tests/aggregator)."""
    deadline, last = time.monotonic() + seconds, None
    while time.monotonic() < deadline:
        try:
            metas = [
                json.load(urlopen(f"http://127.0.0.1:{p}/jsz", timeout=2))["meta_cluster"]
                for p in monitor_ports
            ]
        except (OSError, ValueError, KeyError) as err:
            last = err
        else:
            leaders = {m.get("leader") for m in metas}
            current = [r for m in metas if m.get("replicas") for r in m["replicas"] if r.get("current")]
            if len(leaders) == 1 and None not in leaders and len(current) == len(monitor_ports) - 1:
                return
            last = metas
        time.sleep(0.2)
    raise AssertionError(f"no JetStream meta group in {seconds} s: {last}")


@pytest.mark.timeout(120)
def test_the_three_servers_form_jetstream_and_carry_a_sidecars_deltas_to_a_shard(tmp_path):
    """A sidecar publishes on server 0 as sidecar-llama, a shard reads on server 2 as
    aggregator-llama: the routes, JetStream and the shipped users work together."""
    if shutil.which("nats-server") is None:
        pytest.skip("nats-server is not installed (make system-deps installs it as root)")
    processes, ports, monitors = cluster_on_loopback(tmp_path)
    _, env = nats_config(tmp_path)

    def options(role: str, port: int) -> NatsOptions:
        password = env[f"{role.upper()}_LLAMA_PASSWORD"]
        return NatsOptions(f"nats://{role}-llama:{password}@127.0.0.1:{port}")

    try:
        meta_group_formed(monitors, 30)
        publisher, intake = asyncio.run(
            reaches_a_shard(
                options("sidecar", ports[0]), "llama", options("aggregator", ports[2]), replicas=3, seconds=60
            )
        )
        assert intake.fleet.replicas["a"].resident == 40 and publisher.dropped == {}
        config, copies = asyncio.run(stream_replicas(options("aggregator", ports[1])))
        assert config == 3 and copies == 3  # the shard made it on three servers, all three hold it
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=10)


async def stream_replicas(options: NatsOptions) -> tuple[int, int]:
    """The pool's stream as JetStream tells: its configured replicas and the servers holding it."""
    import nats

    nc = await nats.connect(**options.connect_kwargs())
    try:
        info = await nc.jetstream().stream_info("kvcache-llama")
        return info.config.num_replicas, 1 + len(info.cluster.replicas or [])
    finally:
        await nc.close()
