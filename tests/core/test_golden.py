"""The exporter's whole exposition, fed from the real seed-scenario run, against a committed golden file.

Regenerate after an intended change with: UPDATE_GOLDEN=1 pytest tests/core/test_golden.py
"""

import os
import shutil
import subprocess

from prometheus_client import CollectorRegistry, generate_latest

from kvcache_exporter.exposition import SampleCollector
from tests.conftest import REPO
from tests.replay import replay, seed_snapshots

GOLDEN = REPO / "tests" / "golden" / "seed-scenario.prom"


def exposition(shared_fixtures) -> bytes:
    exporter = replay([s["text"] for s in seed_snapshots(shared_fixtures)], windows=(60.0, 300.0))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(lambda: exporter.latest))
    return generate_latest(registry)


def test_exposition_matches_golden(shared_fixtures):
    text = exposition(shared_fixtures)
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_bytes(text)
    assert text.decode() == GOLDEN.read_text()


def test_golden_passes_promtool_check_metrics():
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: make test installs Debian's prometheus package"
    result = subprocess.run([promtool, "check", "metrics"], input=GOLDEN.read_bytes(), capture_output=True)
    assert result.returncode == 0, result.stdout.decode() + result.stderr.decode()
