"""Shared test helpers: where ../shared lives, free ports."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_FIXTURES = REPO.parent / "shared" / "fixtures"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def shared_fixtures() -> Path:
    assert SHARED_FIXTURES.is_dir(), f"{SHARED_FIXTURES} is missing: tests need ../shared beside the repo"
    return SHARED_FIXTURES
