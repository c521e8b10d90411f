"""A prompt trace: one request per JSON line (seed-scenario trace.jsonl format or text prompts)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..simulator import tokenizer

DEFAULT_MAX_TOKENS = 16
MAX_TOKEN_ID = 2**32 - 1
MAX_GENERATED = 2**20
"""max_tokens above this is a broken line (the replays allocate blocks for every generated token)"""


@dataclass
class TraceRequest:
    prompt_token_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    session: str | None = None
    send_ts: float | None = None
    forced_output: list[int] | None = None
    index: int = 0
    instance: str | None = None
    """server_instance: a change empties the cache (a restart)"""


def parse_trace_line(
    obj: dict, index: int, default_max_tokens: int = DEFAULT_MAX_TOKENS, encoder=None
) -> TraceRequest:
    """`encoder`: the model's tokenizer (analyzer.tokenize.ModelTokenizer) for text; else the simulator's."""
    encoder = encoder or tokenizer
    if "prompt_token_ids" in obj:
        tokens = [int(t) for t in obj["prompt_token_ids"]]
    elif isinstance(obj.get("prompt"), list):
        tokens = [int(t) for t in obj["prompt"]]
    elif isinstance(obj.get("prompt"), str):
        tokens = encoder.encode(obj["prompt"])
    elif isinstance(obj.get("messages"), list):
        if not all(isinstance(m, dict) for m in obj["messages"]):
            raise ValueError(f"line {index + 1}: messages must be objects with role and content")
        tokens = encoder.encode_chat(obj["messages"])
    else:
        raise ValueError(f"line {index + 1}: needs prompt_token_ids, prompt or messages")
    if not tokens:
        raise ValueError(f"line {index + 1}: empty prompt")
    if min(tokens) < 0 or max(tokens) > MAX_TOKEN_ID:
        raise ValueError(f"line {index + 1}: token ids must be in 0..{MAX_TOKEN_ID}")
    max_tokens = int(obj.get("max_tokens") or default_max_tokens)
    if not 1 <= max_tokens <= MAX_GENERATED:
        raise ValueError(f"line {index + 1}: max_tokens must be in 1..{MAX_GENERATED}")
    session = obj.get("session", obj.get("user"))
    ts = obj.get("send_ts", obj.get("timestamp"))
    return TraceRequest(
        tokens,
        max_tokens,
        None if session is None else str(session),
        _seconds(ts),
        obj.get("completion_token_ids"),
        int(obj.get("i", index)),
        None if obj.get("server_instance") is None else str(obj["server_instance"]),
    )


def load_trace(path: str | Path, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[TraceRequest]:
    return parse_trace(Path(path).read_text().splitlines(), default_max_tokens)


def parse_trace(lines: Iterable[str], default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(lines):
        if line.strip():
            out.append(parse_trace_line(json.loads(line), n, default_max_tokens))
    return out


def _seconds(value) -> float | None:
    """A numeric send time in seconds; other forms (ISO strings in some logs) are not used for timing."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
