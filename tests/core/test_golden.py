"""The whole exposition of `serve`'s own wiring (config.resolve -> build_exporter), fed from real parts
by golden_driver.py, against committed golden files; and every catalog family must be in it.

Regenerate after an intended change with: UPDATE_GOLDEN=1 pytest tests/core/test_golden.py
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache_exporter import catalog
from tests.conftest import REPO

DRIVER = Path(__file__).with_name("golden_driver.py")
GOLDEN = {gpu: REPO / "tests" / "golden" / f"serve-{gpu}.prom" for gpu in ("nvml", "dcgm")}
# Catalog groups that `serve` does not export, and where they are tested instead.
SERVED_ELSEWHERE = {
    "fleet": "`kvcache-exporter aggregate` (tests/aggregator)",
    "sglang": "serve polling SGLang (tests/sources/test_sglang.py, tests/integration/test_real_sglang.py)",
}


def exposition(gpu: str, fake_nvml_dir: Path) -> str:
    env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_dir)}
    done = subprocess.run([sys.executable, DRIVER, gpu], env=env, capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()
    return done.stdout.decode()


@pytest.mark.parametrize("gpu", sorted(GOLDEN))
def test_serve_exposition_matches_golden(gpu, fake_nvml_dir):
    text = exposition(gpu, fake_nvml_dir)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN[gpu].write_text(text)
    assert text == GOLDEN[gpu].read_text()


def test_golden_covers_every_catalog_family():
    exported = set(re.findall(r"^# TYPE (\S+)", GOLDEN["nvml"].read_text(), re.M))
    missing = [m.name for m in catalog.CATALOG if m.group not in SERVED_ELSEWHERE and m.name not in exported]
    assert missing == [], (
        f"catalog families missing from {GOLDEN['nvml'].name}: feed what produces them in "
        "tests/core/golden_driver.py (serve's wiring, real inputs), then UPDATE_GOLDEN=1 pytest "
        "tests/core/test_golden.py; a family `serve` never exports belongs in SERVED_ELSEWHERE"
    )
    assert not exported - set(catalog.BY_NAME), "the golden holds families the catalog does not know"


@pytest.mark.parametrize("gpu", sorted(GOLDEN))
def test_golden_passes_promtool_check_metrics(gpu):
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: make test installs Debian's prometheus package"
    result = subprocess.run(
        [promtool, "check", "metrics"], input=GOLDEN[gpu].read_bytes(), capture_output=True
    )
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
