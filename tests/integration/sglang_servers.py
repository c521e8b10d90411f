"""A REAL SGLang 0.5.23 server on this CPU, started once per test session (like conftest.py's vLLM).

`make sglang-venv` (scripts/install-sglang-cpu.sh) installs it, cached outside the repository; a missing
venv is a test failure, never a skip. ../shared/tools/sglang-cpu/run_server_hicache.sh runs it: a tiny
Llama with random weights, page size 4, its radix cache, KV events (ZMQ PUB bound on a port it is
told, with replay) and HiCache's host tier (write-through), so one server serves every SGLang test:
device hits, host-tier hits, evictions past both tiers and /flush_cache. Prompts are token ids
(`--skip-tokenizer-init`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvcache_exporter.tools.harness import Service, StartError, free_port, http_get, stop

ROOT = Path(__file__).resolve().parents[2]
SGLANG_TOOL = ROOT.parent / "shared" / "tools" / "sglang-cpu"
SGLANG_VENV = Path(
    os.environ.get("SGLANG_VENV")
    or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    / "kvcache-exporter"
    / "sglang-cpu-venv"
)
SGLANG_START_TIMEOUT_S = float(os.environ.get("KVCACHE_TEST_SGLANG_START_TIMEOUT", "900"))  # 1-8 min here
PAGE = 4
DEVICE_TOKENS = 256  # 64 pages; HiCache's host tier holds twice that (--hicache-ratio 2)


@dataclass
class SglangServer(Service):
    """The real SGLang process as a harness Service, with the port its KV events are published on."""

    kv_events_port: int = 0

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def log(self, lines: int = 80) -> str:
        return self.log_tail(lines)

    def get(self, path: str) -> tuple[int, str]:
        status, body = http_get(self.url + path, timeout=10)
        return status, body.decode(errors="replace")

    def post(self, path: str, payload: dict) -> bytes:
        request = urllib.request.Request(
            self.url + path, json.dumps(payload).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as answer:
            return answer.read()

    def generate(self, input_ids: list[int]) -> None:
        self.post(
            "/generate", {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
        )

    def flush_cache(self) -> None:
        self.post("/flush_cache", {})  # SGLang publishes AllBlocksCleared


# Module scope: SGLang's scheduler polls while idle (most of a core here), so it is stopped as soon as
# the one module that reads it is done instead of slowing the rest of the session on CI's 2 cores.
@pytest.fixture(scope="module")
def sglang_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SglangServer]:
    python = SGLANG_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(
            f"{python} is missing: run `make sglang-venv` (about 30 s from uv's cache)", pytrace=False
        )
    tmp = tmp_path_factory.mktemp("sglang")
    port = free_port()
    kv_port = free_port()
    env = {
        **os.environ,
        "SGLANG_PYTHON": str(python),
        "PORT": str(port),
        "KV_PORT": str(kv_port),
        "REPLAY_PORT": str(free_port()),
        "TMPDIR": str(tmp),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    log_path = tmp / "sglang.log"
    script = SGLANG_TOOL / "run_server_hicache.sh"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            ["bash", str(script), "--max-total-tokens", str(DEVICE_TOKENS), "--served-model-name", "tiny"],
            cwd=tmp, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    server = SglangServer("SGLang", port, proc, log_path, kv_events_port=kv_port)
    started = time.monotonic()
    try:
        try:
            server.wait_answering("/health", SGLANG_START_TIMEOUT_S)
        except StartError as err:
            pytest.fail(str(err), pytrace=False)
        print(f"\nSGLang started in {time.monotonic() - started:.1f} s (log: {log_path})", file=sys.stderr)
        yield server
    finally:
        stop(proc, grace=15)
