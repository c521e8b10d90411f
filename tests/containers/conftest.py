"""Podman for the image tests: the exporter's image, and Prometheus and Alertmanager images from
Debian's packages, all built on a base made without any registry (deploy/podman/base-image.sh).

Where podman cannot run (not root, no podman, mmdebstrap or catatonit) every test here skips and
says why; `make image-test` installs them when root, so CI on this machine kind runs them.
"""

from __future__ import annotations

import os

import pytest

from tests.containers.harness import ROOT, TIMINGS, Podman, skip_reason, timed


@pytest.fixture(scope="session")
def podman() -> Podman:
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    tool = Podman()
    tool.base_image()
    return tool


@pytest.fixture(scope="session")
def exporter_image(podman):
    tag = f"localhost/kvcache-exporter:test-{os.getpid()}"
    timed("exporter image", lambda: podman.build(tag, str(ROOT)))
    TIMINGS["exporter image MB"] = int(podman("image", "inspect", "--format", "{{.Size}}", tag).stdout) / 1e6
    yield tag
    podman("rmi", "--force", tag, check=False)
    # Old runs' untagged build stages; a day's worth stays as the build cache.
    podman("image", "prune", "--force", "--filter", "until=24h", check=False)


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        figures = ", ".join(f"{k} {v:.1f}" + ("" if k.endswith("MB") else " s") for k, v in TIMINGS.items())
        terminalreporter.write_line(f"containers: {figures}")
