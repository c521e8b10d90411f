"""A prompt trace: one request per JSON line (seed-scenario trace.jsonl format or text prompts)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..simulator import tokenizer
from .lines import json_object

DEFAULT_MAX_TOKENS = 16
MAX_TOKEN_ID = 2**32 - 1
MAX_GENERATED = 2**20
"""max_tokens above this is a broken line (the replays allocate blocks for every generated token)"""
MAX_PROMPT_TOKENS = 2**20
"""a prompt longer than this (after tokenizing) is a broken line"""
MAX_LABEL = 1024
"""characters of a session or server_instance"""


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
    """`encoder`: the model's tokenizer (analyzer.tokenize.ModelTokenizer) for text; else the simulator's.
    Every field is checked: a bad one is a ValueError naming it (the caller adds `file:line:`)."""
    encoder = encoder or tokenizer
    obj = request_body(obj)
    try:
        tokens = _prompt(obj, encoder)
    except RecursionError:
        raise ValueError("messages nested too deeply") from None
    if not tokens:
        raise ValueError(f"line {index + 1}: empty prompt")
    if len(tokens) > MAX_PROMPT_TOKENS:
        raise ValueError(
            f"line {index + 1}: prompt of {len(tokens):,} tokens, more than {MAX_PROMPT_TOKENS:,}"
        )
    max_tokens = int_field(obj, "max_tokens", default_max_tokens, 1, MAX_GENERATED)
    if "max_tokens" not in obj and "max_completion_tokens" in obj:
        max_tokens = int_field(obj, "max_completion_tokens", default_max_tokens, 1, MAX_GENERATED)
    output = obj.get("completion_token_ids")
    if output is not None:
        output = _token_ids(output, "completion_token_ids", MAX_GENERATED)
    session = obj.get("session", obj.get("user"))
    instance = obj.get("server_instance")
    return TraceRequest(
        tokens,
        max_tokens,
        label_field(session, "session"),
        _seconds(obj.get("send_ts", obj.get("timestamp"))),
        output,
        int_field(obj, "i", index, 0, 2**63 - 1),
        label_field(instance, "server_instance"),
    )


BATCH_URLS = {"/v1/chat/completions", "/v1/completions"}


def request_body(obj: dict) -> dict:
    """An OpenAI Batch API input line (`custom_id`, `method`, `url`, `body`) is its body; others as they
    are."""
    if "body" not in obj or not ("custom_id" in obj or "url" in obj):
        return obj
    url, body = obj.get("url"), obj["body"]
    if url not in BATCH_URLS:
        raise ValueError(f"batch line for {str(url)[:60]!r}: only {' and '.join(sorted(BATCH_URLS))} prompts")
    if not isinstance(body, dict):
        raise ValueError("batch line's body must be an object")
    return body


def _prompt(obj: dict, encoder) -> list[int]:
    if "prompt_token_ids" in obj:
        return _token_ids(obj["prompt_token_ids"], "prompt_token_ids", MAX_PROMPT_TOKENS)
    prompt = obj.get("prompt")
    if isinstance(prompt, list):
        return _token_ids(prompt, "prompt", MAX_PROMPT_TOKENS)
    if isinstance(prompt, str):
        return encoder.encode(prompt)
    messages = obj.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role", "user"), str):
                raise ValueError("messages must be objects with a role and content")
            if not isinstance(m.get("content", ""), str | list | type(None)):
                raise ValueError("a message's content must be text or a list of parts")
        return encoder.encode_chat(messages)
    if prompt is not None or messages is not None:
        raise ValueError("prompt must be text or token ids, messages a list")
    raise ValueError("needs prompt_token_ids, prompt or messages (or an OpenAI Batch API line)")


def _token_ids(value, name: str, limit: int) -> list[int]:
    """A list of token ids, checked before anything is built from it."""
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of token ids, not {type(value).__name__}")
    if len(value) > limit:
        raise ValueError(f"{name} has {len(value):,} tokens, more than {limit:,}")
    for t in value:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise ValueError(f"{name} must hold token ids in 0..{MAX_TOKEN_ID}, not {str(t)[:20]!r}")
    return value


def int_field(obj: dict, key: str, default: int, low: int, high: int) -> int:
    value = obj.get(key)
    if value is None:
        return default
    if type(value) is not int or not low <= value <= high:
        raise ValueError(f"{key} must be in {low}..{high} (an integer), not {str(value)[:20]!r}")
    return value


def label_field(value, key: str) -> str | None:
    """A session or instance label: text, or any other JSON value as its text, within MAX_LABEL."""
    if value is None:
        return None
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_LABEL:
        raise ValueError(f"{key} longer than {MAX_LABEL} characters")
    return text


def load_trace(path: str | Path, default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[TraceRequest]:
    return parse_trace(Path(path).read_text().splitlines(), default_max_tokens)


def parse_trace(lines: Iterable[str], default_max_tokens: int = DEFAULT_MAX_TOKENS) -> list[TraceRequest]:
    out = []
    for n, line in enumerate(lines):
        if line.strip():
            out.append(parse_trace_line(json_object(line), n, default_max_tokens))
    return out


def _seconds(value) -> float | None:
    """A numeric send time in seconds; other forms (ISO strings in some logs) are not used for timing."""
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None
