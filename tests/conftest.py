"""Shared test helpers: where ../shared lives; ports and processes come from kvcache_exporter.harness."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvcache_exporter.harness import Services, free_port

__all__ = ["REPO", "SHARED_FIXTURES", "free_port"]

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"


@pytest.fixture
def shared_fixtures() -> Path:
    assert SHARED_FIXTURES.is_dir(), f"{SHARED_FIXTURES} is missing: tests need ../shared beside the repo"
    return SHARED_FIXTURES


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Services]:
    """Start real processes on loopback (simulator, exporter, Prometheus, ...); all stop after the test."""
    with Services(tmp_path / "services") as started:
        yield started
