"""A real vLLM as a backend: prompts sent one at a time by token ids (completions, max_tokens 1, or the
request's `answer` sampled with a per-request seed and read back by `return_token_ids`), its ZMQ KV
events received on the endpoint its PUB connects to (bound here) and decoded by the sidecar's
decoder. Before moving on, every request's events must have arrived: vLLM's own counters say what it
computed (prefix_cache_queries - prefix_cache_hits), and the batches are read until the stored blocks
cover that and the generated tokens but the last (never fed back), whole blocks only (a partial last
block is computed but never stored).

`launch` starts the tiny Llama the integration suite uses (tests/integration/conftest.py), for
`make accuracy`; the suite's test hands its session-wide server to `RealVllm` instead.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import zmq

from ..sources.kv_events_decode import Batch, decode_message
from ..tools.harness import StartError, free_ports, http_get, stop, wait_until
from .workload import KINDS, Request, Shape

# A reset is vLLM's /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1); restarting vLLM per case takes ~25 s,
# the tiny Llama has no sliding window and this server no host tier.
NOT_ON_VLLM = frozenset({"engine_restart", "window_dropped", "host_tier_load"})
BLOCK_SIZE, KV_CACHE_BYTES, MAX_MODEL_LEN = 32, "2M", 1024  # conftest.py's: 64 blocks of 32 tokens
EVENTS_TIMEOUT_S = 10.0
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


def llama_shape(blocks: int = 64) -> Shape:
    kinds = tuple(k for k in KINDS if k not in NOT_ON_VLLM)
    return Shape("vLLM 0.32 CPU, tiny Llama", BLOCK_SIZE, blocks * BLOCK_SIZE, MAX_MODEL_LEN - 1, kinds)


@dataclass
class Counters:
    queries: float
    hits: float


class RealVllm:
    def __init__(self, base_url: str, kv_events_endpoint: str, shape: Shape, model: str = "tiny"):
        self.base_url, self.shape, self.model = base_url, shape, model
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(kv_events_endpoint)
        self.late = 0  # requests whose events never covered what vLLM computed (see `send`)
        self.counters = self._counters()

    def close(self) -> None:
        self.socket.close()

    def warm_up(self, timeout: float = 60.0) -> None:
        """vLLM's PUB connects to the fresh bind in the background: send throwaway prompts until a batch
        arrives, then drain what is left."""
        deadline, prompt = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            prompt += 1
            self._complete([20 + (prompt * 7 + i) % 480 for i in range(3 * BLOCK_SIZE + 1)], None)
            if self.socket.poll(1000):
                while self.socket.poll(300):
                    self.socket.recv_multipart()
                self.counters = self._counters()
                return
        raise StartError(f"no KV events from vLLM within {timeout:g} s")

    def send(self, request: Request) -> tuple[list[Batch], tuple[int, ...]]:
        if request.before == "reset":
            reset = urllib.request.Request(self.base_url + "/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(reset, timeout=60):
                pass
        elif request.before is not None:
            raise ValueError(f"vLLM cannot {request.before} here")
        before = self.counters
        generated = self._complete(list(request.prompt), request.identity, request.answer)
        self.counters = after = self._counted(before, len(request.prompt))
        computed = int((after.queries - before.queries) - (after.hits - before.hits))
        fed = computed + max(len(generated) - 1, 0)  # the generated tokens fed back: all but the last
        return self._batches(fed // BLOCK_SIZE * BLOCK_SIZE), generated

    def _complete(self, prompt: list[int], identity: str | None, answer: int = 0) -> tuple[int, ...]:
        """The completion; the token ids it generated (read back only when `answer` asks for some)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        if answer:  # sampled, seeded: varied text whatever the (dummy) weights favour
            body |= {"max_tokens": answer, "temperature": 1.0, "seed": len(prompt), "return_token_ids": True}
        if identity is not None:
            body["cache_salt"] = identity
        post = urllib.request.Request(
            self.base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(post, timeout=120) as response:
            reply = json.loads(response.read())
        return tuple(reply["choices"][0].get("token_ids") or ()) if answer else ()

    def _counters(self) -> Counters:
        status, body = http_get(self.base_url + "/metrics")
        if status != 200:
            raise StartError(f"vLLM /metrics answered {status}")
        return counters_from(body.decode())

    def _counted(self, before: Counters, prompt_tokens: int) -> Counters:
        """The counters once they include this request's lookup (queries grow by its prompt)."""
        deadline = time.monotonic() + EVENTS_TIMEOUT_S
        while (now := self._counters()).queries - before.queries < prompt_tokens:
            if time.monotonic() > deadline:
                raise StartError(f"vLLM's prefix_cache_queries did not count a {prompt_tokens}-token prompt")
            time.sleep(0.01)
        return now

    def _batches(self, want: int) -> list[Batch]:
        """Batches until their GPU stores hold `want` tokens, then any that follow within 20 ms."""
        batches, seen, deadline = [], 0, time.monotonic() + EVENTS_TIMEOUT_S
        while seen < want and time.monotonic() < deadline:
            if self.socket.poll(100):
                batches.append(decode_message(self.socket.recv_multipart(), with_tokens=True))
                seen += stored_tokens(batches[-1])
        if seen < want:
            self.late += 1
        while self.socket.poll(20):
            batches.append(decode_message(self.socket.recv_multipart(), with_tokens=True))
        return batches


def counters_from(text: str) -> Counters:
    """vLLM's prefix-cache queries and hits, summed over engines, from its /metrics page."""
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():  # two counters of a long page: no full parse
        if line.startswith(COUNTERS):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
    return Counters(*values.values())


def stored_tokens(batch: Batch) -> int:
    """Tokens the batch's GPU stores hold (a CPU tier's stores are copies, not computed)."""
    return sum(
        len(e.block_hashes) * e.block_size
        for e in batch.events
        if e.type == "BlockStored" and e.medium in (None, "GPU")
    )


@contextlib.contextmanager
def launch(python: Path, model: Path, workdir: Path, timeout: float = 900.0) -> Iterator[tuple[str, str]]:
    """A real vLLM CPU server on loopback with conftest.py's flags: (base URL, KV-event endpoint)."""
    port, kv_port = free_ports(2)
    kv_events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{kv_port}",
        "topic": "kv",
    }
    command = [
        str(python.absolute()), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model.absolute()), "--load-format", "dummy", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
        "--enforce-eager", "--enable-prefix-caching", "--block-size", str(BLOCK_SIZE),
        "--kv-cache-memory-bytes", KV_CACHE_BYTES, "--kv-events-config", json.dumps(kv_events),
    ]  # fmt: skip
    env = {
        **os.environ,
        "TMPDIR": str(workdir),
        "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
        "HF_HOME": str(workdir / "hf"),
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache, loopback only
    }
    env.pop("VIRTUAL_ENV", None)
    log_path = workdir / "vllm.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                raise StartError(f"vLLM exited with {proc.returncode}: see {log_path}")
            return http_get(base_url + "/health", timeout=2)[0] == 200

        wait_until(healthy, "vLLM to answer /health", timeout, every=0.5)
        yield base_url, f"tcp://127.0.0.1:{kv_port}"
    finally:
        stop(proc)
