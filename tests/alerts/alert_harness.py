"""Shared paths and tool lookup for the alert tests. Missing tools fail the tests (never skip)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALERTS = ROOT / "alerts"
RULES = ALERTS / "rules"
RULE_TESTS = sorted((ALERTS / "tests").glob("*.yaml"))
AM_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"


def tool(*names: str) -> str:
    for name in names:
        if path := shutil.which(name):
            return path
    raise AssertionError(
        f"{' or '.join(names)} not on PATH: apt-get install -y prometheus prometheus-alertmanager"
    )


def run(*cmd: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def generate(out: Path, scale: float = 1.0) -> None:
    run(sys.executable, "-m", "alerts.generate", "--out", out, "--scale", str(scale))
