"""The real parts on loopback, for tests, the demo, the benchmarks and the soak: free ports, processes
that always stop, and launchers for the simulator, the exporter, Prometheus and Alertmanager.

    with Services(tmp_path) as services:
        sim = services.simulator("--rate", "20")
        exporter = services.exporter("--vllm.url", sim.url + "/metrics")
        prometheus = services.prometheus(scrape_config(exporter))

Every process gets its own session and a log file in the work directory; leaving the block stops
them all, newest first (SIGTERM to the process group, then SIGKILL). A process that dies or does
not answer in time raises StartError with the end of its log. `serve` never imports this module.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CLI = (sys.executable, "-m", "kvcache_exporter")


class StartError(RuntimeError):
    """A process exited early or never answered; the message carries its log tail."""


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(count: int) -> list[int]:
    """`count` distinct free ports (two quick binds can return the same one)."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def bindable(port: int) -> bool:
    """Whether `port` is free on the loopback address now."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body); an HTTP error answers with its status instead of raising."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def binary(*names: str) -> str:
    """The first of `names` on PATH or beside this interpreter."""
    for name in names:
        found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
        if found:
            return found
    raise StartError(f"none of {', '.join(names)} is installed (Debian: apt-get install prometheus ...)")


def wait_until(check: Callable[[], T], what: str, timeout: float = 30.0, every: float = 0.2) -> T:
    """The first truthy result of `check()` (OSError counts as not yet), else StartError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            if result := check():
                return result
        time.sleep(every)
    raise StartError(f"timed out after {timeout:g}s waiting for {what}")


def wait_showing(url: str, want: str, timeout: float = 60.0) -> str:
    """GET `url` until its body shows `want`: that body, else StartError."""

    def body() -> str:
        text = http_get(url, timeout=2)[1].decode()
        return text if want in text else ""

    return wait_until(body, f"{url} to show {want}", timeout)


def stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM the process group (children included), then SIGKILL whatever is left. For processes
    started in a session of their own (start_new_session=True), as Services starts them."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    while time.monotonic() < deadline:  # children may outlive the leader for a moment
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@dataclass
class Service:
    name: str
    port: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError as err:
            return f"(no log: {err})"

    def wait_answering(self, path: str, timeout: float = 30.0, needle: bytes = b"") -> None:
        """Until GET `path` answers 200 (with `needle` in the body); StartError if the process exits."""

        def answering() -> bool:
            if self.proc.poll() is not None:
                raise StartError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            status, body = http_get(self.url + path, timeout=2)
            return status == 200 and needle in body

        try:
            wait_until(answering, f"{self.name} to answer {path}", timeout)
        except StartError as err:
            if self.proc.poll() is not None:
                raise
            raise StartError(f"{err}\n--- {self.name} log ({self.log_path}) ---\n{self.log_tail()}") from None


class Services:
    """The processes of one test, demo or benchmark run; stopped newest first on exit."""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.started: list[Service] = []

    def __enter__(self) -> Services:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        while self.started:
            stop(self.started.pop().proc)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        port: int,
        ready: str | None = "/",
        timeout: float = 30.0,
        needle: bytes = b"",
        env: dict[str, str] | None = None,
    ) -> Service:
        """Run `argv` (which listens on `port`) and wait until GET `ready` answers 200 (None: no wait)."""
        log_path = self.workdir / f"{name}-{len(self.started)}.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                env={**os.environ, **(env or {})},
                start_new_session=True,  # its own group: stop() reaches its children too
            )
        service = Service(name, port, proc, log_path)
        self.started.append(service)
        if ready is not None:
            service.wait_answering(ready, timeout, needle)
        return service

    def simulator(self, *args: str, port: int | None = None, timeout: float = 30.0) -> Service:
        """`kvcache-exporter simulate`, a vLLM-compatible server, on `port` or a free one."""
        port = port or free_port()
        argv = [*CLI, "simulate", "--listen", f"127.0.0.1:{port}", *args]
        return self.start("simulator", argv, port, "/metrics", timeout)

    def exporter(
        self, *args: str, port: int | None = None, timeout: float = 30.0, command: Sequence[str] = CLI
    ) -> Service:
        """`kvcache-exporter serve <args>` on `port` or a free one, until /metrics answers."""
        port = port or free_port()
        argv = [*command, "serve", *args, "--web.listen-address", f"127.0.0.1:{port}"]
        return self.start("exporter", argv, port, "/metrics", timeout)

    def prometheus(self, config: str, *args: str, timeout: float = 30.0) -> Service:
        """Debian's Prometheus with `config` (YAML text), a fresh TSDB, until /-/ready."""
        return self._configured("prometheus", prometheus_argv, config, args, timeout)

    def alertmanager(self, config: str, *args: str, timeout: float = 30.0) -> Service:
        """Alertmanager with `config` (YAML text), no clustering, until /-/ready."""
        return self._configured("alertmanager", alertmanager_argv, config, args, timeout)

    def _configured(
        self, name: str, argv: Callable[..., list[str]], config: str, args: Sequence[str], timeout: float
    ) -> Service:
        """`name` on a free port with `config` written to a file and a data folder of its own."""
        port = free_port()
        path = self.workdir / f"{name}-{port}.yml"
        path.write_text(config)
        data = self.workdir / f"{name}-data-{port}"
        return self.start(name, argv(path, data, port, *args), port, "/-/ready", timeout)


def prometheus_argv(config: Path, data: Path, port: int, *args: str, command: str | None = None) -> list[str]:
    """How every run of Prometheus is started (tests, demo, bench): loopback, its own TSDB."""
    return [
        command or binary("prometheus"),
        f"--config.file={config}",
        f"--storage.tsdb.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        *args,
    ]


def alertmanager_argv(
    config: Path, data: Path, port: int, *args: str, command: str | None = None
) -> list[str]:
    return [
        command or binary("prometheus-alertmanager", "alertmanager"),
        f"--config.file={config}",
        f"--storage.path={data}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--cluster.listen-address=",  # no gossip port to find or to clash
        *args,
    ]


def scrape_config(*targets: Service, interval: str = "1s", job: str = "kvcache-exporter") -> str:
    """A minimal prometheus.yml scraping `targets` every `interval`."""
    hosts = ", ".join(f"'127.0.0.1:{t.port}'" for t in targets)
    return (
        f"global: {{scrape_interval: {interval}, evaluation_interval: {interval}}}\n"
        f"scrape_configs:\n- job_name: {job}\n  static_configs: [{{targets: [{hosts}]}}]\n"
    )


# --- a real vLLM CPU server: one launcher for tests/integration/conftest.py and `make accuracy` ----------

TINY_LLAMA_BLOCK = 32
TINY_LLAMA_ARGS = (  # 64 blocks of 32 tokens: small enough that a workload evicts
    "--max-model-len", "1024", "--block-size", str(TINY_LLAMA_BLOCK), "--kv-cache-memory-bytes", "2M",
)  # fmt: skip


def vllm_argv(python: Path, model: Path, port: int, kv_port: int, *args: str) -> list[str]:
    """A real vLLM's OpenAI server on loopback: dummy weights served as "tiny", eager, prefix caching, its
    KV events published on ZMQ to tcp://127.0.0.1:`kv_port` (rank r on kv_port + r; a subscriber binds)."""
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{kv_port}",
        "topic": "kv",
    }
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--load-format", "dummy", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--enable-prefix-caching",
        "--kv-events-config", json.dumps(kv_events), *args,
    ]  # fmt: skip


def vllm_env(workdir: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM's environment: caches and temp files in `workdir`, offline, the dev-mode reset endpoint."""
    env = {
        **os.environ,
        "TMPDIR": str(workdir),
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "HF_HOME": str(workdir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache (AllBlocksCleared), loopback only
        "PYTHONUNBUFFERED": "1",
        **(extra or {}),
    }
    env.pop("VIRTUAL_ENV", None)
    return env


def spawn_logged(argv: Sequence[str], workdir: Path, env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """`argv` in a session of its own (stop() reaches its children), output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            list(argv), cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def cpu_ms(fn, repeat: int) -> tuple[float, float]:
    """Median and p90 CPU milliseconds of fn() over `repeat` runs."""
    samples = []
    for _ in range(repeat):
        start = time.process_time()
        fn()
        samples.append((time.process_time() - start) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.9) - 1]
