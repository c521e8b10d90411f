"""A real nats-server (Debian's, JetStream on) on a free loopback port, for the fleet-on-NATS tests.

Installed by `make system-deps`; tests that need it skip with the reason where it is absent (a
machine without root), never pass without it."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import free_port

BINARY = shutil.which("nats-server")


class NatsServer:
    def __init__(
        self,
        store: Path,
        user: str | None = None,
        password: str | None = None,
        config: str = "",
        env: dict[str, str] | None = None,
    ):
        """`config`: nats-server configuration text (TLS, users, includes), `env` its $VARIABLES."""
        self.store, self.user, self.password = store, user, password
        self.config, self.env = config, env
        self.port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f"{self.user}:{self.password}@" if self.user else ""
        return f"nats://{auth}127.0.0.1:{self.port}"

    def start(self) -> NatsServer:
        if BINARY is None:
            pytest.skip("nats-server is not installed (make system-deps installs it as root)")
        args = [BINARY, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        if self.user:
            args += ["--user", self.user, "--pass", str(self.password)]
        if self.config:
            path = self.store.parent / f"nats-{self.port}.conf"
            path.write_text(self.config)
            args += ["-c", str(path)]
        env = {**os.environ, **self.env} if self.env else None
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.process.stderr.read().decode()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not listen within 15 s")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None
