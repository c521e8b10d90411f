import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FAKE_NVML_SOURCE = REPO / "tests" / "fixtures" / "nvml" / "fake_nvml.c"
DRIVER = Path(__file__).with_name("nvml_driver.py")


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
