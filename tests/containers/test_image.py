"""The exporter's image, built on the registry-free base and run as in Kubernetes: non-root, read-only
root filesystem, no capabilities, no privilege escalation, beside the simulator in one pod."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.containers.harness import free_port

LOCKED_DOWN = ["--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges"]


def get(url: str, timeout: float = 60) -> tuple[int, str]:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            if time.monotonic() > deadline:
                return err.code, err.read().decode()
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
        time.sleep(0.5)


def samples(text: str) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample.value)
    return out


def test_runtime_image_holds_no_build_test_or_dashboard_tools(podman, exporter_image):
    probe = "import importlib.util as u; print([m for m in MODULES if u.find_spec(m)])".replace(
        "MODULES", repr(("pytest", "hypothesis", "ruff", "grafana_foundation_sdk", "pip", "setuptools"))
    )
    found = podman("run", "--rm", *LOCKED_DOWN, "--entrypoint", "python3", exporter_image, "-c", probe)
    assert found.stdout.strip() == "[]"
    compilers = podman(
        "run", "--rm", "--entrypoint", "sh", exporter_image, "-c", "command -v gcc cc", check=False
    )
    assert compilers.returncode != 0 and compilers.stdout == ""
    (config,) = json.loads(podman("image", "inspect", exporter_image).stdout)
    assert config["Config"]["User"] == "10001:10001"
    assert "http://127.0.0.1:18090/healthz" in " ".join(config["Healthcheck"]["Test"])  # kept: docker format


@pytest.fixture
def pod(podman, exporter_image):
    name, port = f"kvcache-image-test-{free_port()}", free_port()
    podman("pod", "create", "--name", name, "--publish", f"127.0.0.1:{port}:18090")
    simulate = ["simulate", "--listen", "127.0.0.1:8000", "--kv-events-endpoint", "tcp://*:5557"]
    podman("run", "--detach", "--pod", name, "--name", f"{name}-simulator", *LOCKED_DOWN, "--no-healthcheck",
           "--entrypoint", "kvcache-exporter", exporter_image, *simulate)  # fmt: skip
    env = {
        "KVCACHE_EXPORTER_VLLM_URL": "http://127.0.0.1:8000/metrics",
        "KVCACHE_EXPORTER_COLLECT_INTERVAL": "1s",
        "KVCACHE_EXPORTER_KV_EVENTS_ENDPOINT": "tcp://127.0.0.1:5557",
        "KVCACHE_EXPORTER_KV_EVENTS_MODE": "connect",
    }
    env_args = [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    podman(
        "run",
        "--detach",
        "--pod",
        name,
        "--name",
        f"{name}-exporter",
        *LOCKED_DOWN,
        *env_args,
        exporter_image,
    )
    yield f"{name}-exporter", f"http://127.0.0.1:{port}"
    podman("pod", "rm", "--force", "--time", "2", name, check=False)


def test_locked_down_exporter_scrapes_the_simulator_beside_it(podman, pod):
    container, base = pod
    assert get(base + "/readyz") == (200, "ready\n")
    deadline = time.monotonic() + 60
    while "kvcache_prefix_cache_hit_ratio" not in (series := samples(get(base + "/metrics")[1])):
        assert time.monotonic() < deadline, sorted(series)
        time.sleep(1)
    assert series["kvcache_vllm_up"] == [1.0]
    for derived in ("kvcache_prefix_cache_hit_ratio", "kvcache_block_utilization_ratio"):
        assert series[derived] and all(0 <= v <= 1 for v in series[derived]), derived
    assert podman("exec", container, "id", "-u").stdout.strip() == "10001"
    written = podman("exec", container, "touch", "/opt/kvcache/x", check=False)
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    (state,) = json.loads(podman("inspect", container).stdout)
    assert "no-new-privileges" in state["HostConfig"]["SecurityOpt"]
    assert state["EffectiveCaps"] in (None, [])
    assert podman("healthcheck", "run", container).returncode == 0


def test_exporter_stops_cleanly_on_sigterm(podman, pod):
    container, base = pod
    assert get(base + "/readyz")[0] == 200
    start = time.monotonic()
    podman("stop", "--time", "10", container)  # SIGTERM, then SIGKILL after 10 s
    assert time.monotonic() - start < 5
    assert podman("inspect", "--format", "{{.State.ExitCode}}", container).stdout.strip() == "0"
    assert "msg=stopped" in podman("logs", container).stderr
