"""From a built wheel, installed into a fresh venv outside the checkout (no `dashboards` extra):
`kvcache-exporter mixin` and `kvcache-exporter demo` work with what the package ships."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

pytestmark = pytest.mark.slow
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")


def _run(*argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=180, **kw)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """bin/ of a venv holding only the wheel and its pinned dependencies."""
    assert UV, "uv is installed by `make venv`"
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # only what a clean clone has: no egg-info, no build/ left in the checkout
    shutil.copytree(
        REPO / "exporter", src / "exporter", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__")
    )
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy(REPO / name, src / name)
    built = _run(UV, "build", "--wheel", "--out-dir", tmp / "dist", src)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp / "dist").glob("*.whl")
    assert _run(UV, "venv", "-q", tmp / "venv").returncode == 0
    py = tmp / "venv" / "bin" / "python"
    done = _run(UV, "pip", "install", "-q", "--python", py, "-c", REPO / "constraints.txt", wheel)
    assert done.returncode == 0, done.stderr
    return py.parent


def _cli(installed: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return _run(installed / "kvcache-exporter", *args, cwd=cwd, env=env)


def test_the_package_is_the_wheel_not_the_checkout(installed, tmp_path):
    where = _run(
        installed / "python", "-c", "import kvcache_exporter; print(kvcache_exporter.__file__)", cwd=tmp_path
    )
    assert str(installed.parent) in where.stdout and str(REPO) not in where.stdout
    sdk = _run(installed / "python", "-c", "import grafana_foundation_sdk", cwd=tmp_path)
    assert sdk.returncode != 0  # the extra is not installed: the fallback below is what users get


def test_mixin_from_the_wheel(installed, tmp_path):
    done = _cli(installed, "mixin", "--output", tmp_path / "out", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for name in ("kvcache-overview.json", "kvcache-cache.json", "kvcache-gpu-cost.json"):
        assert (tmp_path / "out/dashboards" / name).read_bytes() == (
            REPO / "dashboards/json" / name
        ).read_bytes()
    assert (tmp_path / "out/alertmanager/templates/kvcache.tmpl").is_file()
    committed = yaml.safe_load((REPO / "alerts/rules/alerts.yaml").read_text())
    assert yaml.safe_load((tmp_path / "out/rules/alerts.yaml").read_text()) == committed

    (same := tmp_path / "same.yaml").write_text(
        "alerts: {KVCacheSaturated: {for: 20m}}\nurls: {grafana: http://g}\n"
    )
    fits = _cli(installed, "mixin", "--output", tmp_path / "same", "--config", same, cwd=tmp_path)
    assert fits.returncode == 0, fits.stderr  # nothing a dashboard shows changed: the shipped JSON fits
    assert "for: 20m" in (tmp_path / "same/rules/alerts.yaml").read_text()
    overview = "dashboards/kvcache-overview.json"
    assert (tmp_path / "same" / overview).read_bytes() == (
        REPO / "dashboards/json/kvcache-overview.json"
    ).read_bytes()

    (mine := tmp_path / "mine.yaml").write_text("alerts: {KVCacheSaturated: {threshold: 0.8}}\n")
    refused = _cli(installed, "mixin", "--output", tmp_path / "mine", "--config", mine, cwd=tmp_path)
    assert refused.returncode == 1 and "kvcache-exporter[dashboards]" in refused.stderr
    assert "Traceback" not in refused.stderr and not (tmp_path / "mine").exists()
    rules_only = _cli(
        installed, "mixin", "--output", tmp_path / "mine", "--config", mine, "--no-dashboards", cwd=tmp_path
    )
    assert rules_only.returncode == 0, rules_only.stderr
    assert "> 0.8" in (tmp_path / "mine/rules/alerts.yaml").read_text()
    assert not (tmp_path / "mine/dashboards").exists()


def _loaded_rules(prometheus: str, deadline: float) -> list[dict]:
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(prometheus + "/api/v1/rules", timeout=2) as answer:
                groups = json.load(answer)["data"]["groups"]
        except (OSError, ValueError, KeyError):
            groups = []
        rules = [rule for group in groups for rule in group["rules"]]
        if rules:
            return rules
        time.sleep(0.5)
    return []


def test_demo_from_the_wheel_loads_the_alert_rules(installed, tmp_path):
    assert shutil.which("prometheus"), "Debian's prometheus is needed: make system-deps"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    argv = [
        installed / "kvcache-exporter",
        "demo",
        "--phase-seconds",
        "10",
        "--duration",
        "40",
        "--refresh",
        "1",
    ]
    demo = subprocess.Popen(
        argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    lines, prometheus = [], None
    try:
        deadline = time.monotonic() + 40
        while prometheus is None and time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("demo: prometheus "):
                prometheus = line.split()[-1]
        assert prometheus, "".join(lines) + demo.stderr.read() if demo.poll() is not None else "".join(lines)
        rules = _loaded_rules(prometheus, time.monotonic() + 20)
    finally:
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=30)
    printed = "".join(lines) + out
    assert "alert rules skipped" not in printed, printed
    alerts = {r["name"]: r for r in rules if r["type"] == "alerting"}
    assert "KVCacheHitRatioBelowFloor" in alerts, printed
    assert alerts["KVCacheHitRatioBelowFloor"]["labels"] == {"severity": "critical"}
    assert any(r["type"] == "recording" for r in rules)
    assert demo.returncode == 0, err
