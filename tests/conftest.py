"""Shared test helpers: where ../shared lives; ports and processes come from the tools harness."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from kvcache_exporter.tools.harness import Services, free_port

__all__ = ["REPO", "SHARED_FIXTURES", "exposition_captures", "free_port"]

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"

# No per-example time limit: a deadline is a timed assertion, and on a loaded two-core CI machine it
# fails tests whose code is right (speed is measured by `make bench`).
settings.register_profile("kvcache", deadline=None)
settings.load_profile("kvcache")


def exposition_captures() -> list[Path]:
    """Every captured /metrics page in ../shared/fixtures (vLLM's and SGLang's): the text files that
    are neither decoded KV events nor SGLang's list of metric types."""
    return [
        p
        for p in sorted(SHARED_FIXTURES.glob("*/*.txt"))
        if "kv-events" not in p.name and "metric-types" not in p.name
    ]


FAKE_NVML_SOURCE = REPO / "tests" / "fixtures" / "nvml" / "fake_nvml.c"


@pytest.fixture
def shared_fixtures() -> Path:
    assert SHARED_FIXTURES.is_dir(), f"{SHARED_FIXTURES} is missing: tests need ../shared beside the repo"
    return SHARED_FIXTURES


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    """Start real processes on loopback (simulator, exporter, Prometheus, ...); all stop after the test."""
    with Services(tmp_path / "services") as started:
        yield started


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory) -> Path:
    """A directory holding the stand-in libnvidia-ml.so.1, built with the machine's C compiler."""
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in NVML library")
    out = tmp_path_factory.mktemp("fake_nvml")
    subprocess.run(
        [
            compiler,
            "-shared",
            "-fPIC",
            "-Wl,-soname,libnvidia-ml.so.1",
            "-o",
            out / "libnvidia-ml.so.1",
            FAKE_NVML_SOURCE,
        ],
        check=True,
    )
    return out
