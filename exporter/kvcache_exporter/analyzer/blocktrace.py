"""Traces as chains of block ids: Mooncake / Alibaba-Qwen block-hash traces and token-id traces.

A request is its prompt's chain of *groups*: a group is one trace block (Mooncake: 512 tokens, Qwen: 16)
or one vLLM block (token-id traces), `width` vLLM blocks wide. Equal group ids mean equal prefixes, so no
token list is ever built for a hash trace (a 145M-token day is a few hundred thousand ints).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import count

from .lines import json_object
from .trace import MAX_GENERATED, MAX_PROMPT_TOKENS, TraceRequest, int_field, label_field

MOONCAKE_BLOCK = 512
QWEN_BLOCK = 16


@dataclass(slots=True)
class BlockRequest:
    groups: list[int]
    widths: list[int]
    """full vLLM blocks in each group"""
    prompt_tokens: int
    max_tokens: int
    session: str | None = None
    timestamp: float | None = None
    """seconds"""
    instance: str | None = None
    """server_instance: a change empties the cache (a restart)"""
    tokens: list[int] | None = None
    """the prompt's token ids (token-id traces only): content matching for prefix_diverged"""


@dataclass
class Parsed:
    requests: list[BlockRequest]
    kind: str
    """mooncake | qwen | tokens"""
    skipped: list[str]
    """`file:line: message` for each line left out"""
    traces: list[TraceRequest]
    """token-id traces: the requests themselves (for the engine replay and the structure)"""
    text: bool = False
    """some prompts were text (tokenized here)"""


class Interner(dict):
    def id(self, key) -> int:
        value = self.get(key)
        if value is None:
            value = self[key] = len(self)
        return value


def is_hash_trace(obj: dict) -> bool:
    return "hash_ids" in obj


def from_hash_line(
    obj: dict, trace_block: int, block_size: int, ids: Interner, sessions: dict
) -> BlockRequest:
    hash_ids = obj["hash_ids"]
    if not isinstance(hash_ids, list) or not hash_ids:
        raise ValueError("hash_ids must be a non-empty list")
    if len(hash_ids) * trace_block > MAX_PROMPT_TOKENS * 64:
        raise ValueError(f"{len(hash_ids):,} hash_ids: a prompt beyond any model's context")
    if any(type(h) is not int for h in hash_ids):
        raise ValueError("hash_ids must be integers")
    length = int_field(obj, "input_length", len(hash_ids) * trace_block, 1, 2**63 - 1)
    if not (len(hash_ids) - 1) * trace_block < length <= len(hash_ids) * trace_block:
        raise ValueError(f"input_length {length} does not match {len(hash_ids)} blocks of {trace_block}")
    groups = [ids.id(h) for h in hash_ids]
    widths = [trace_block // block_size] * len(groups)
    widths[-1] = (length - (len(groups) - 1) * trace_block) // block_size
    output = int_field(obj, "output_length", 1, 1, MAX_GENERATED)
    ts = obj.get("timestamp")
    if ts is not None and (type(ts) not in (int, float) or not math.isfinite(ts)):
        raise ValueError("timestamp must be a number")
    session = label_field(obj.get("session", obj.get("user")), "session")
    if "chat_id" in obj:  # Qwen: a turn belongs to its first turn's conversation
        chat = label_field(obj["chat_id"], "chat_id")
        parent = label_field(obj.get("parent_chat_id"), "parent_chat_id")
        session = sessions.get(parent, chat) if parent not in (None, "-1") else chat
        sessions[chat] = session
        seconds = None if ts is None else float(ts)
    else:
        seconds = None if ts is None else float(ts) / 1000.0  # Mooncake: milliseconds
    return BlockRequest(
        groups,
        widths,
        length,
        output,
        session,
        seconds,
        label_field(obj.get("server_instance"), "server_instance"),
    )


def from_tokens(request: TraceRequest, block_size: int, ids: Interner) -> BlockRequest:
    tokens = request.prompt_token_ids
    groups, parent = [], -1
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = ids.id((parent, tuple(tokens[start : start + block_size])))
        groups.append(parent)
    return BlockRequest(
        groups,
        [1] * len(groups),
        len(tokens),
        request.max_tokens,
        request.session,
        request.send_ts,
        request.instance,
        tokens,
    )


@dataclass(frozen=True)
class Selection:
    """Which lines become requests: `phase` (the lines' `phase` field) then positions first..last (0-based,
    inclusive, counted over the lines of that phase)."""

    phase: str | None = None
    first: int = 0
    last: int | None = None


def parse_lines(
    lines: Iterable[str | tuple[int, str | ValueError]],
    name: str,
    block_size: int,
    trace_block_size: int | None = None,
    default_max_tokens: int = 16,
    parse_tokens=None,
    progress=None,
    select: Selection = Selection(),
) -> Parsed:
    """Every good line of a trace as a BlockRequest; bad ones become `name:line: message`. `lines`: text
    lines, or (number, text or the reason it could not be read) as lines.read_lines gives them."""
    ids, sessions = Interner(), {}
    out: list[BlockRequest] = []
    skipped: list[str] = []
    traces: list[TraceRequest] = []
    kind, position, text = None, -1, False
    for number, line in _numbered(lines):
        if progress is not None:
            progress("parse", number)
        try:
            if isinstance(line, ValueError):
                raise line
            obj = json_object(line)
            if select.phase is not None and obj.get("phase") != select.phase:
                continue
            position += 1
            if position < select.first or (select.last is not None and position > select.last):
                continue
            if kind is None:
                kind = ("qwen" if "chat_id" in obj else "mooncake") if is_hash_trace(obj) else "tokens"
            if kind == "tokens":
                request = (parse_tokens or _parse_token_line)(obj, number - 1, default_max_tokens)
                text = text or _is_text(obj)
                out.append(from_tokens(request, block_size, ids))
                traces.append(request)
            else:
                tbs = trace_block_size or (QWEN_BLOCK if kind == "qwen" else MOONCAKE_BLOCK)
                out.append(from_hash_line(obj, tbs, block_size, ids, sessions))
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as err:
            message = str(err).removeprefix(f"line {number}: ")
            skipped.append(f"{name}:{number}: {message}")
    return Parsed(out, kind or "tokens", skipped, traces, text)


def _is_text(obj: dict) -> bool:
    body = obj.get("body") if isinstance(obj.get("body"), dict) else obj
    return isinstance(body.get("prompt"), str) or "messages" in body


def _numbered(lines) -> Iterator[tuple[int, str | ValueError]]:
    for number, line in enumerate(lines, 1):
        if isinstance(line, tuple):
            yield line
        elif line.strip():
            yield number, line


def _parse_token_line(obj: dict, index: int, default_max_tokens: int) -> TraceRequest:
    from .trace import parse_trace_line

    return parse_trace_line(obj, index, default_max_tokens)


def check_block_sizes(block_size: int, trace_block_size: int) -> None:
    if block_size < 1 or trace_block_size % block_size:
        raise ValueError(f"--block-size {block_size} must divide --trace-block-size {trace_block_size}")


def total_blocks(request: BlockRequest, block_size: int) -> int:
    """KV blocks the request holds at its end (prompt + max_tokens - 1 computed tokens)."""
    return -(-(request.prompt_tokens + request.max_tokens - 1) // block_size)


def block_key(group: int, j: int) -> bytes:
    """The pool key of vLLM block j of trace group `group` (group ids already name a whole prefix)."""
    return group.to_bytes(8, "big", signed=True) + j.to_bytes(4, "big")


def prompt_keys(request: BlockRequest) -> list[bytes]:
    """The keys of the prompt's full vLLM blocks, in order (block_key's, built a group at a time)."""
    keys: list[bytes] = []
    for g, w in zip(request.groups, request.widths, strict=True):
        head = g.to_bytes(8, "big", signed=True)
        keys += [head + j.to_bytes(4, "big") for j in range(w)]
    return keys


def fresh_keys() -> Iterator[bytes]:
    """Keys no trace group has (negative ids): for blocks holding generated tokens."""
    return (block_key(-n, 0) for n in count(1))


def longest(requests: Sequence[BlockRequest], block_size: int) -> int:
    return max((total_blocks(r, block_size) for r in requests), default=1)
