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

import base64
import contextlib
import json
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zmq

from ..sources.kv_events_decode import Batch, decode_message
from ..tools.harness import (
    TINY_LLAMA_ARGS,
    TINY_LLAMA_BLOCK,
    StartError,
    free_ports,
    http_get,
    spawn_logged,
    stop,
    vllm_argv,
    vllm_env,
    wait_until,
)
from .workload import KINDS, Request, Shape

# A reset is vLLM's /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1); restarting vLLM per case takes ~25 s,
# the tiny Llama has no sliding window and this server no host tier.
NOT_ON_VLLM = frozenset({"engine_restart", "window_dropped", "host_tier_load"})
BLOCK_SIZE, MAX_MODEL_LEN = TINY_LLAMA_BLOCK, 1024  # TINY_LLAMA_ARGS: 64 blocks of 32 tokens
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
    def __init__(
        self,
        base_url: str,
        kv_events_endpoint: str,
        shape: Shape,
        model: str = "tiny",
        record: IO | None = None,
    ):
        self.base_url, self.shape, self.model, self.record = base_url, shape, model, record
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
        frames = self._frames(fed // BLOCK_SIZE * BLOCK_SIZE)
        if self.record is not None:  # a line a request, flushed: a run cut short still replays
            self.record.write(
                json.dumps(Sent(len(request.prompt), tuple(frames), generated).to_json()) + "\n"
            )
            self.record.flush()
        return [decode_message(f, with_tokens=True) for f in frames], generated

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

    def _frames(self, want: int) -> list[list[bytes]]:
        """Event messages until their GPU stores hold `want` tokens, then any that follow within 20 ms."""
        frames, seen, deadline = [], 0, time.monotonic() + EVENTS_TIMEOUT_S
        while seen < want and time.monotonic() < deadline:
            if self.socket.poll(100):
                frames.append(self.socket.recv_multipart())
                seen += stored_tokens(decode_message(frames[-1], with_tokens=True))
        if seen < want:
            self.late += 1
        while self.socket.poll(20):
            frames.append(self.socket.recv_multipart())
        return frames


@dataclass(frozen=True)
class Sent:
    """One request as a real server answered it: its prompt's length, the KV-event messages it caused
    (raw, as received) and the token ids it generated."""

    prompt_tokens: int
    frames: tuple[list[bytes], ...]
    generated: tuple[int, ...]

    def to_json(self) -> dict:
        frames = [[base64.b64encode(part).decode() for part in frame] for frame in self.frames]
        return {"prompt_tokens": self.prompt_tokens, "frames": frames, "generated": list(self.generated)}

    @classmethod
    def from_json(cls, data: dict) -> Sent:
        frames = tuple([base64.b64decode(part) for part in frame] for frame in data["frames"])
        return cls(data["prompt_tokens"], frames, tuple(data["generated"]))


class Replayed:
    """A recorded real run sent again: the same server's events for the same requests, so that rules
    changed since are scored on real bytes without the server. The cases must be the ones recorded
    (same generator, seed and shape): a request whose prompt length differs from the record's stops it."""

    def __init__(self, shape: Shape, recorded: list[Sent]):
        self.shape, self.recorded = shape, iter(recorded)

    def send(self, request: Request) -> tuple[list[Batch], tuple[int, ...]]:
        sent = next(self.recorded, None)
        if sent is None or sent.prompt_tokens != len(request.prompt):
            raise ValueError("the recording is not of these cases (regenerate it: make accuracy)")
        return [decode_message(f, with_tokens=True) for f in sent.frames], sent.generated


def load_recording(path: Path) -> tuple[dict, list[Sent]]:
    """A recording's first line (what was planned; the run's figures when it finished: `minutes`) and
    its requests; a last line cut off mid-write is left out."""
    header, recorded = {}, []
    with open(path) as lines:
        for number, line in enumerate(lines):
            try:
                data = json.loads(line)
            except json.JSONDecodeError:
                break
            if number == 0:
                header = data
            elif "prompt_tokens" in data:
                recorded.append(Sent.from_json(data))
            else:
                header |= data
    return header, recorded


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
def launch(
    python: Path, model: Path, workdir: Path, args: tuple[str, ...] = TINY_LLAMA_ARGS, timeout: float = 900.0
) -> Iterator[tuple[str, str]]:
    """A real vLLM CPU server on loopback, launched as the integration suite launches it (tools/harness.py):
    (base URL, KV-event endpoint)."""
    port, kv_port = free_ports(2)
    argv = vllm_argv(python.absolute(), model.absolute(), port, kv_port, *args)
    log_path = workdir / "vllm.log"
    proc = spawn_logged(argv, workdir, vllm_env(workdir), log_path)
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
