"""Built-in traffic: the seed's e-commerce prompts (raw / normalized), multi-turn chat, trace replay,
and the schedule that switches between them over (simulated) time."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..durations import parse_duration

TOKEN_LOW, TOKEN_HIGH = 5, 500
USER_LABEL, TIMESTAMP_LABEL, ORDER_LABEL = 7, 8, 9


@dataclass
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    session: str
    forced_output: list[int] | None = None
    gap_s: float | None = None
    """Time since the previous request, when the workload dictates it (trace replay)."""
    lora_name: str | None = None
    session_id: str | None = None
    report_full: bool = False


class Workload:
    name = "base"

    def next_request(self) -> RequestSpec | None:
        raise NotImplementedError

    def on_response(self, spec: RequestSpec, output_token_ids: list[int]) -> None:
        """Feedback for workloads whose next prompt depends on the answer (chat)."""


def _tokens(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(TOKEN_LOW, TOKEN_HIGH) for _ in range(rng.randint(low, high))]


@dataclass
class CustomerServiceCorpus:
    """The seed's static parts: a 200-token system block and 30 recurring questions of 20-60 tokens."""

    seed: int
    system: list[int] = field(init=False)
    questions: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        rng = random.Random(self.seed)
        self.system = _tokens(rng, 200, 200)
        self.questions = [_tokens(rng, 20, 60) for _ in range(30)]


Encode = Callable[[str], list[int]]


class CustomerService(Workload):
    """`raw`: dynamic header (user id, timestamp, order no.) first; `normalized`: header last. With
    `encode` (the model's tokenizer) the header is real text, `User [ID:48213] at 2026-...`."""

    def __init__(
        self,
        layout: str,
        corpus: CustomerServiceCorpus,
        rng: random.Random,
        max_tokens: int,
        encode: Encode | None = None,
    ) -> None:
        if layout not in ("raw", "normalized"):
            raise ValueError(f"unknown layout {layout!r}")
        self.name = layout
        self._corpus, self._rng, self._max_tokens, self._encode = corpus, rng, max_tokens, encode
        self._customer = 0

    def _header(self) -> list[int]:
        rng = self._rng
        if self._encode is not None:
            month, day, hour, minute = (
                rng.randint(1, 12),
                rng.randint(1, 28),
                rng.randint(0, 23),
                rng.randint(0, 59),
            )
            stamp = f"2026-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:00"
            user, order = rng.randint(10**4, 10**6 - 1), rng.randint(10**6, 10**8 - 1)
            return self._encode(f"User [ID:{user}] at {stamp} asks about order [NO:{order}]: ")
        header = [USER_LABEL, *_tokens(rng, 3, 5), TIMESTAMP_LABEL, *_tokens(rng, 4, 6), ORDER_LABEL]
        return header + _tokens(rng, 2, 6)

    def next_request(self) -> RequestSpec:
        rng = self._rng
        header = self._header()
        question = rng.choice(self._corpus.questions)
        static = self._corpus.system + question
        prompt = header + static if self.name == "raw" else static + header
        self._customer += 1
        return RequestSpec(prompt, self._max_tokens, f"cust-{self._customer:03d}")


class MultiTurnChat(Workload):
    """Sessions that grow turn by turn: system block + every previous question and answer + a new question."""

    name = "chat"

    def __init__(
        self,
        corpus: CustomerServiceCorpus,
        rng: random.Random,
        max_tokens: int,
        sessions: int = 16,
        max_turns: int = 6,
        dropped: int = 0,
    ) -> None:
        self._corpus, self._rng, self._max_tokens = corpus, rng, max_tokens
        self._sessions, self._max_turns = sessions, max_turns
        self._dropped = dropped  # each answer's first tokens the history leaves out (the reasoning)
        self._history: dict[str, list[int]] = {}
        self._turns: dict[str, int] = {}
        self._in_flight: set[str] = set()
        self._next_id = 0

    def next_request(self) -> RequestSpec:
        idle = [s for s in self._history if s not in self._in_flight]
        if len(self._history) < self._sessions or not idle:
            session = f"chat-{self._next_id:04d}"
            self._next_id += 1
            self._history[session] = list(self._corpus.system)
            self._turns[session] = 0
        else:
            session = self._rng.choice(idle)
        prompt = self._history[session] + _tokens(self._rng, 10, 40)
        self._history[session] = prompt
        self._in_flight.add(session)
        return RequestSpec(list(prompt), self._max_tokens, session)

    def on_response(self, spec: RequestSpec, output_token_ids: list[int]) -> None:
        session = spec.session
        self._in_flight.discard(session)
        if session not in self._history:
            return
        self._history[session] = self._history[session] + output_token_ids[self._dropped :]
        self._turns[session] += 1
        if self._turns[session] >= self._max_turns:
            del self._history[session], self._turns[session]


class TraceReplay(Workload):
    """Replays a trace.jsonl (seed-scenario format) in order with its inter-arrival gaps; loops."""

    name = "trace"

    def __init__(self, path: str | Path) -> None:
        self._lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        if not self._lines:
            raise ValueError(f"{path}: empty trace")
        self._index = 0

    def next_request(self) -> RequestSpec:
        position = self._index % len(self._lines)
        line = self._lines[position]
        previous = self._lines[position - 1] if position else None
        self._index += 1
        gap = line["send_ts"] - previous["send_ts"] if previous and "send_ts" in line else 0.0
        session = line.get("session")
        return RequestSpec(
            list(line["prompt_token_ids"]),
            int(line.get("max_tokens") or 16),
            f"trace-{line.get('i', self._index)}" if session is None else str(session),
            forced_output=line.get("completion_token_ids"),
            gap_s=max(gap, 0.0),
        )


class ManyTemplates(Workload):
    """More recurring templates than the KV cache holds: 40 templates of 1,000 tokens (2,500 blocks of 16
    against the simulator's default 2,048), picked uniformly, each with a short per-request question
    last. Templates come back after they were evicted: the misses are `evicted`, not `prefix_diverged`."""

    name = "templates"

    def __init__(self, rng: random.Random, max_tokens: int, templates: int = 40, length: int = 1000) -> None:
        self._rng, self._max_tokens = rng, max_tokens
        self._templates = [
            [rng.randint(TOKEN_LOW, TOKEN_HIGH) for _ in range(length)] for _ in range(templates)
        ]
        self._next = 0

    def next_request(self) -> RequestSpec:
        self._next += 1
        prompt = self._rng.choice(self._templates) + _tokens(self._rng, 10, 30)
        return RequestSpec(prompt, self._max_tokens, f"tpl-{self._next:05d}")


class RerankedDocuments(Workload):
    """Retrieval: the system block, then 4 shared documents (96-160 tokens) in the order a
    per-request ranking gives, then the question. The same documents in another order are known
    content that does not hit: the misses are `content_moved` (sorted, they would hit)."""

    name = "documents"

    def __init__(self, corpus: CustomerServiceCorpus, rng: random.Random, max_tokens: int) -> None:
        self._corpus, self._rng, self._max_tokens = corpus, rng, max_tokens
        self._documents = [_tokens(random.Random(corpus.seed + i), 96, 160) for i in range(4)]
        self._next = 0

    def next_request(self) -> RequestSpec:
        self._next += 1
        ranked = self._rng.sample(self._documents, 4)
        prompt = self._corpus.system + [t for document in ranked for t in document]
        prompt += self._rng.choice(self._corpus.questions)
        return RequestSpec(prompt, self._max_tokens, f"rag-{self._next:05d}")


WORKLOAD_NAMES = ("raw", "normalized", "chat", "chat_rewritten", "documents", "templates", "trace", "none")
REASONING_TOKENS = 96  # chat_rewritten: each answer's first tokens the template drops (DeepSeek-R1-style)


class WorkloadFactory:
    def __init__(
        self,
        seed: int,
        max_tokens: int = 32,
        trace_path: str | None = None,
        tokenizer_path: str | None = None,
    ) -> None:
        self._corpus = CustomerServiceCorpus(seed)
        self._rng = random.Random(seed + 1)
        self._max_tokens = max_tokens
        self._trace_path = trace_path
        self._encode = text_encoder(tokenizer_path) if tokenizer_path else None

    def make(self, name: str) -> Workload | None:
        if name in ("raw", "normalized"):
            return CustomerService(name, self._corpus, self._rng, self._max_tokens, self._encode)
        if name == "chat":
            return MultiTurnChat(self._corpus, self._rng, self._max_tokens)
        if name == "chat_rewritten":  # answers long enough to keep text after the dropped reasoning
            answer = max(self._max_tokens, 2 * REASONING_TOKENS)
            return MultiTurnChat(self._corpus, self._rng, answer, dropped=REASONING_TOKENS)
        if name == "documents":
            return RerankedDocuments(self._corpus, self._rng, self._max_tokens)
        if name == "templates":
            return ManyTemplates(self._rng, self._max_tokens)
        if name == "trace":
            if not self._trace_path:
                raise ValueError("the trace workload needs --trace PATH")
            return TraceReplay(self._trace_path)
        if name == "none":
            return None
        raise ValueError(f"unknown workload {name!r} (choose from {', '.join(WORKLOAD_NAMES)})")


def text_encoder(path: str) -> Encode:
    """The model's tokenizer (tokenizer.json or its folder) as text -> ids, no special tokens added."""
    from ..model_tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path, "pip install tokenizers")
    return lambda text: tokenizer.encode(text, add_special_tokens=False).ids


def parse_schedule(text: str) -> list[tuple[str, float | None]]:
    """`normalized:60s,raw:60s,normalized` -> [(name, seconds), ...]; a missing duration means "forever"."""
    phases: list[tuple[str, float | None]] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, duration = part.partition(":")
        if name not in WORKLOAD_NAMES:
            raise ValueError(f"unknown workload {name!r} in schedule {text!r}")
        seconds = None
        if duration:
            try:
                seconds = parse_duration(duration)  # the package's one grammar: 60s, 1m30s
            except ValueError as err:
                raise ValueError(f"bad duration {duration!r} in schedule {text!r}: {err}") from None
        phases.append((name, seconds))
    if not phases:
        raise ValueError("empty schedule")
    return phases


def phase_at(phases: list[tuple[str, float | None]], elapsed: float) -> str:
    """Which workload runs `elapsed` simulated seconds into the schedule (the last phase then stays)."""
    for name, seconds in phases:
        if seconds is None or elapsed < seconds:
            return name
        elapsed -= seconds
    return phases[-1][0]


def trace_lines(factory: WorkloadFactory, schedule: str, per_phase: int) -> Iterator[dict]:
    """The schedule's built-in traffic as trace.jsonl lines (`simulate --write-trace`, what `analyze`
    reads): `per_phase` requests of each phase in order, each with its `phase`. A chat turn's answer
    is taken as empty (nothing is generated here)."""
    i = 0
    for name, _ in parse_schedule(schedule):
        workload = factory.make(name)
        for _ in range(per_phase if workload is not None else 0):
            spec = workload.next_request()
            if spec is None:
                break
            workload.on_response(spec, spec.forced_output or [])
            tokens = spec.prompt_token_ids
            yield {
                "i": i,
                "phase": name,
                "session": spec.session,
                "prompt_token_ids": tokens,
                "max_tokens": spec.max_tokens,
            }
            i += 1
