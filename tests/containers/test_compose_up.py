"""docker-compose.yml's demo profile started with podman-compose on locally built images: the
exporter's, and Prometheus and Alertmanager from Debian's packages on the registry-free base.

Grafana is left out: it has no Debian package and no registry can be reached here, so its
provisioning stays checked as files (tests/deploy/test_compose.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.containers.harness import ROOT, TIMINGS, free_port

SERVICES = ["simulator", "exporter-demo", "prometheus", "alertmanager"]
JOBS = {"kvcache-exporter", "vllm", "prometheus"}


def api(base: str, path: str, **query: str) -> dict:
    url = f"{base}/api/v1/{path}" + ("?" + urllib.parse.urlencode(query) if query else "")
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)["data"]


def wait_until(check, timeout: float = 90):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = check()
            if result:
                return result
        except (OSError, KeyError, ValueError):
            pass
        assert time.monotonic() < deadline, f"{check.__doc__} within {timeout} s"
        time.sleep(1)


@pytest.fixture
def stack(podman, exporter_image):
    prometheus, alertmanager = free_port(), free_port()
    env = {
        **podman.env,
        "EXPORTER_IMAGE": exporter_image,
        "PROMETHEUS_IMAGE": podman.debian_image("prometheus"),
        "ALERTMANAGER_IMAGE": podman.debian_image("prometheus-alertmanager"),
        "PROMETHEUS_PORT": f"127.0.0.1:{prometheus}",
        "ALERTMANAGER_PORT": f"127.0.0.1:{alertmanager}",
    }
    compose = [sys.executable, "-m", "podman_compose", "--project-name", f"kvcache-test-{prometheus}"]
    compose += ["--profile", "demo"]
    run = {"cwd": ROOT, "env": env, "capture_output": True, "text": True, "timeout": 300}
    start = time.monotonic()
    up = subprocess.run([*compose, "up", "--detach", "--no-build", *SERVICES], **run)
    assert up.returncode == 0, up.stdout + up.stderr
    TIMINGS["compose up"] = time.monotonic() - start
    try:
        yield f"http://127.0.0.1:{prometheus}", f"http://127.0.0.1:{alertmanager}"
    finally:
        subprocess.run([*compose, "down", "--volumes", "--timeout", "5"], **run)


def rule_names() -> set[str]:
    docs = [yaml.safe_load(p.read_text()) for p in sorted(Path(ROOT / "alerts" / "rules").glob("*.yaml"))]
    return {r.get("alert") or r["record"] for d in docs for g in d["groups"] for r in g["rules"]}


def test_demo_stack_scrapes_every_target_and_loads_the_projects_rules(stack):
    prometheus, alertmanager = stack

    def targets_up():
        """every Prometheus target up"""
        targets = api(prometheus, "targets")["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in targets}
        return health if set(health) == JOBS and set(health.values()) == {"up"} else None

    wait_until(targets_up)
    groups = api(prometheus, "rules")["groups"]
    loaded = {r["name"] for g in groups for r in g["rules"]}
    assert loaded == rule_names() and {r["health"] for g in groups for r in g["rules"]} <= {"ok", "unknown"}
    (manager,) = api(prometheus, "alertmanagers")["activeAlertmanagers"]
    assert manager["url"] == "http://alertmanager:9093/api/v2/alerts"
    with urllib.request.urlopen(f"{alertmanager}/-/ready", timeout=5) as response:
        assert response.status == 200
    # The rules' exporter matcher finds the compose job: KVCacheExporterAbsent's expression is empty.
    job = yaml.safe_load((ROOT / "alerts" / "config.yaml").read_text())["exporter_job"]
    assert api(prometheus, "query", query=f'absent(up{{job=~"{job}"}})')["result"] == []

    def derived():
        """the exporter's derived hit ratio in Prometheus"""
        return api(prometheus, "query", query='kvcache_prefix_cache_hit_ratio{job="kvcache-exporter"}')[
            "result"
        ]

    assert all(0 <= float(s["value"][1]) <= 1 for s in wait_until(derived))
    # Every source of the sidecar works in compose: vLLM, the simulated dcgm-exporter, KV events.
    success = api(prometheus, "query", query='kvcache_exporter_collector_success{job="kvcache-exporter"}')
    assert {s["metric"]["collector"]: s["value"][1] for s in success["result"]} == {
        "vllm": "1", "gpu": "1", "kv_events": "1"
    }  # fmt: skip
