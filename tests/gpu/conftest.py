import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("nvml_driver.py")


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
            [sys.executable, DRIVER, *args], env=environment, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    return run
