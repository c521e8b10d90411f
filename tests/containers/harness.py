"""Podman for the image tests: this project's containers.conf, builds on the registry-free base
(deploy/podman/base-image.sh), and the time each build took (reported at the end of the run)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PODMAN_DIR = ROOT / "deploy" / "podman"
BASE_IMAGE = "localhost/kvcache-base:bookworm"
TIMINGS: dict[str, float] = {}


def skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "not root: podman here needs root (rootless needs subuids); run `make image-test` as root"
    missing = [tool for tool in ("podman", "runc", "mmdebstrap", "catatonit") if not shutil.which(tool)]
    return f"{', '.join(missing)} missing: `make image-test` installs them as root" if missing else None


def _env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(PODMAN_DIR / "containers.conf")}


@dataclass
class Podman:
    env: dict = field(default_factory=_env)

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        done = subprocess.run(
            ["podman", *args], env=self.env, capture_output=True, text=True, timeout=timeout
        )
        if check and done.returncode:
            raise AssertionError(f"podman {' '.join(args)}: {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def base_image(self) -> None:
        script = ["bash", str(PODMAN_DIR / "base-image.sh"), BASE_IMAGE]
        timed("base image", lambda: subprocess.run(script, env=self.env, check=True, capture_output=True))

    def build(self, tag: str, *args: str) -> str:
        # The host's CA bundle for the build's pip and apt only (TLS-intercepting proxies); it is a
        # build-time mount, not a layer, so nothing of it stays in the image.
        self("build", "--quiet", "--format", "docker", "--volume", "/etc/ssl/certs:/etc/ssl/certs:ro",
             "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--tag", tag, *args, timeout=600)  # fmt: skip
        return tag

    def debian_image(self, package: str) -> str:
        """An image of one Debian package, rebuilt only when its Containerfile changes."""
        containerfile = PODMAN_DIR / "Containerfile.debian"
        digest = hashlib.sha256(containerfile.read_bytes()).hexdigest()[:12]
        tag = f"localhost/kvcache-{package}:debian-{digest}"
        if self("image", "exists", tag, check=False).returncode:
            args = ["--build-arg", f"PACKAGE={package}", "-f", str(containerfile), str(PODMAN_DIR)]
            timed(f"{package} image", lambda: self.build(tag, *args))
        return tag


def timed(name: str, action):
    start = time.monotonic()
    result = action()
    TIMINGS[name] = time.monotonic() - start
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
