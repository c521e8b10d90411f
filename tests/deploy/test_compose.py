"""docker-compose.yml, the Prometheus and Grafana configs it mounts, and the Dockerfile.

These check the files with Debian's docker-compose 1.29 and promtool (missing tools fail, never
skip); tests/containers builds the image and starts the stack on podman.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROFILES = {"demo": {"simulator", "exporter-demo"}, "gpu": {"vllm", "exporter-gpu"}}
MONITORING = {"prometheus", "alertmanager", "grafana"}


def tool(name: str) -> str:
    path = shutil.which(name)
    if not path:
        pytest.fail(f"{name} missing: apt-get install -y prometheus docker-compose")
    return path


def compose(profile: str) -> dict:
    """The resolved file, with only the services of `profile` (1.29's `config` prints them all)."""
    cmd = [tool("docker-compose"), "--profile", profile, "config"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    config = yaml.safe_load(done.stdout)
    config["services"] = {k: v for k, v in config["services"].items() if profile in v.get("profiles", [])}
    return config


def mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of the service's bind mounts."""
    out = {}
    for volume in service.get("volumes", []):  # 1.29 prints "/abs/source:/target[:mode]"
        source, target = volume.split(":")[:2]
        if source.startswith("/"):
            out[target] = Path(source)
    return out


def host_path(service: dict, container_path: str) -> Path:
    for target, source in sorted(mounts(service).items(), key=lambda kv: -len(kv[0])):
        if container_path == target or container_path.startswith(target + "/"):
            return source / Path(container_path).relative_to(target)
    raise AssertionError(f"{container_path} is not mounted")


def test_compose_config_is_valid_for_docker_compose_1_29():
    done = subprocess.run([tool("docker-compose"), "config", "-q"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_each_profile_runs_an_engine_its_sidecar_and_the_monitoring(profile):
    services = compose(profile)["services"]
    assert set(services) == PROFILES[profile] | MONITORING
    engine, sidecar = sorted(PROFILES[profile], key=lambda s: s.startswith("exporter"))
    assert services[sidecar]["network_mode"] == f"service:{engine}"
    assert services[sidecar]["read_only"] is True
    for name, service in services.items():
        assert re.fullmatch(r"[\w./-]+:[\w.-]+", service["image"]), name
        assert not service["image"].endswith(":latest"), name
        for source in mounts(service).values():
            assert source.exists(), f"{name}: {source} does not exist"


def test_fleet_profile_runs_jetstream_nats_a_publishing_sidecar_and_a_shard_reading_it():
    services = compose("fleet")["services"]
    assert set(services) == {"nats", "simulator", "exporter-fleet", "aggregator-fleet"}
    assert "-js" in services["nats"]["command"] and "/data" in services["nats"]["command"]
    sidecar, shard = services["exporter-fleet"]["environment"], services["aggregator-fleet"]["environment"]
    assert services["exporter-fleet"]["network_mode"] == "service:simulator"
    assert (
        sidecar["KVCACHE_EXPORTER_FLEET_PUBLISH"]
        == shard["KVCACHE_AGGREGATE_FLEET_SOURCE"]
        == "nats://nats:4222"
    )
    assert sidecar["KVCACHE_EXPORTER_FLEET_POOL"] == shard["KVCACHE_AGGREGATE_FLEET_POOL"]
    for name, service in services.items():
        assert not service["image"].endswith(":latest"), name


def test_gpu_profile_gives_the_exporter_the_gpu():
    services = compose("gpu")["services"]
    for name in ("vllm", "exporter-gpu"):
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"], name
    assert "--enable-prefix-caching" in services["vllm"]["command"]


def test_prometheus_scrapes_the_compose_services_and_loads_the_rules(tmp_path):
    services = compose("demo")["services"]
    config_path = host_path(services["prometheus"], "/etc/prometheus/prometheus.yml")
    config = yaml.safe_load(config_path.read_text())
    assert config["rule_files"] == ["rules/recording.yaml", "rules/alerts.yaml"]
    assert host_path(services["prometheus"], "/etc/prometheus/rules") == ROOT / "alerts" / "rules"
    names = set(services) | {a for s in services.values() for a in aliases(s)}
    targets = {job["job_name"]: job["static_configs"][0]["targets"] for job in config["scrape_configs"]}
    assert targets["kvcache-exporter"] == ["vllm:18090"] and targets["vllm"] == ["vllm:8000"]
    am = config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"]
    for target in [*targets["kvcache-exporter"], *targets["vllm"], *am]:
        assert target.partition(":")[0] in names, target
    # promtool resolves rule files next to the config, as Prometheus does in the container.
    shutil.copy(config_path, tmp_path / "prometheus.yml")
    (tmp_path / "rules").symlink_to(ROOT / "alerts" / "rules")
    done = subprocess.run([tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def aliases(service: dict) -> list[str]:
    return [a for net in (service.get("networks") or {}).values() for a in (net or {}).get("aliases", [])]


def test_grafana_provisioning_points_at_files_that_exist():
    grafana = compose("demo")["services"]["grafana"]
    provisioning = host_path(grafana, "/etc/grafana/provisioning")
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yaml").read_text())[
        "datasources"
    ][:1]
    assert datasource["url"] == "http://prometheus:9090" and datasource["isDefault"]
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "kvcache.yaml").read_text())["providers"]
    folder = host_path(grafana, provider["options"]["path"])
    assert folder == ROOT / "dashboards" / "json"
    assert {p.name for p in folder.glob("*.json")} == {
        "kvcache-overview.json", "kvcache-cache.json", "kvcache-gpu-cost.json", "kvcache-fleet.json"
    }  # fmt: skip
    assert host_path(grafana, grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]).is_file()


def test_dockerfile_runs_as_non_root_with_a_healthcheck():
    text = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11\.\d+-slim-\w+$", text, re.M)  # pinned default
    assert re.findall(r"^FROM (.*)$", text, re.M) == ["${BASE_IMAGE} AS build", "${BASE_IMAGE}"]
    assert "COPY --from=build /opt/kvcache /opt/kvcache" in text  # the runtime stage gets the venv only
    assert "--constraint constraints.txt ." in text
    (user,) = re.findall(r"^USER (\S+)$", text, re.M)
    assert user.split(":")[0] not in ("0", "root")
    assert re.search(r"^HEALTHCHECK .*\n?.*http://127\.0\.0\.1:18090/healthz", text, re.M)
    ignored = (ROOT / ".dockerignore").read_text()
    assert ignored.startswith("#") and "\n*\n" in ignored  # only what the image needs is sent
