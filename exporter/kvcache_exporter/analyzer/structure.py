"""Prefix structure of a trace: shared prefixes, unique first blocks, the dynamic field."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ..derive.fields import classify, shape
from ..derive.front_fields import MAX_FRONT_TOKENS
from .reorder import DynamicField, Layout, dynamic_field
from .trace import TraceRequest


@dataclass
class SharedPrefix:
    tokens: int
    requests: int
    head: list[int]
    """the first tokens of the prefix"""
    text: str | None = None
    """the whole prefix as text (when the trace was tokenized by a known tokenizer)"""


@dataclass
class Structure:
    requests: int
    first_block_unique_share: float
    """share of the requests (with at least one full block) whose first block no other request has"""
    shared_prefixes: list[SharedPrefix]
    dynamic_field: DynamicField | None
    block_granularity_loss: float
    """share of prompt tokens shared with an earlier request but lost to partial blocks"""


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_prefixes(
    prompts: Sequence[Sequence[int]], min_requests: int, top: int = 5, decode=None
) -> list[SharedPrefix]:
    """Common prefixes (token level) shared by at least `min_requests` prompts: the nodes of the prompts'
    prefix tree where it branches, found as LCP intervals of the sorted prompts; largest tokens x requests
    first."""
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    ordered = [prompts[i] for i in order]
    lcps = [_lcp(ordered[i - 1], ordered[i]) for i in range(1, len(ordered))]
    found: dict[tuple[int, int], int] = {}  # (length, first row) -> rows
    stack: list[tuple[int, int]] = []  # (lcp length, left row)
    for i, h in enumerate([*lcps, 0]):
        left = i
        while stack and stack[-1][0] > h:
            length, left = stack.pop()
            rows = i + 1 - left
            if length > 0 and rows >= min_requests:
                found[(length, left)] = rows
        if not stack or stack[-1][0] < h:
            stack.append((h, left))
    best = sorted(found.items(), key=lambda item: (-item[0][0] * item[1], -item[0][0]))[:top]
    return [
        SharedPrefix(
            length,
            rows,
            list(ordered[left][: min(length, 12)]),
            decode(ordered[left][:length]) if decode else None,
        )
        for (length, left), rows in best
    ]


def structure(
    requests: Sequence[TraceRequest], block_size: int, layouts: Sequence[Layout | None], decode=None
) -> Structure:
    """`layouts`: each request's (reorder.layouts); `decode`: token ids to text, for the shared prefixes."""
    prompts = [r.prompt_token_ids for r in requests]
    firsts = Counter(tuple(p[:block_size]) for p in prompts if len(p) >= block_size)
    with_block = sum(firsts.values())
    unique = sum(n for n in firsts.values() if n == 1)
    # Token-level sharing with any earlier request vs what whole blocks can hold.
    lost = total = 0
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    best = [0] * len(prompts)
    for a, b in itertools.pairwise(order):
        n = _lcp(prompts[a], prompts[b])
        later = max(a, b)  # only the later of the two can reuse the earlier one's blocks
        best[later] = max(best[later], n)
    for p, shared in zip(prompts, best, strict=True):
        shared = min(shared, len(p) - 1)
        total += len(p)
        lost += shared - (shared // block_size) * block_size
    dynamic = dynamic_field(layouts)
    if dynamic is not None and decode is not None:
        dynamic.field, dynamic.shape = named_field(prompts, layouts, decode)
    return Structure(
        len(prompts),
        unique / with_block if with_block else 0.0,
        shared_prefixes(prompts, max(2, len(prompts) // 20), decode=decode),
        dynamic,
        lost / total if total else 0.0,
    )


HEAD_CONTEXT = 8
"""tokens of the shared head decoded with the per-request part: a field's label (`[ID:`) sits there"""
NAMED_REQUESTS = 500


def named_field(
    prompts: Sequence[Sequence[int]], layouts: Sequence[Layout | None], decode
) -> tuple[str, str]:
    """The first per-request field's kind and the redacted shape, the most common over the first
    NAMED_REQUESTS requests with a dynamic part, as the sidecar names them (derive/fields.py): the
    first field that reaches past the shared head."""
    seen: Counter[tuple[str, str]] = Counter()
    moved = ((p, lay) for p, lay in zip(prompts, layouts, strict=True) if lay is not None)
    for prompt, lay in itertools.islice(moved, NAMED_REQUESTS):
        start = max(lay.head - HEAD_CONTEXT, 0)
        stop = min(lay.template, start + MAX_FRONT_TOKENS)
        head, text = _decoded(decode, prompt[start : lay.head]), _decoded(decode, prompt[start:stop])
        found = classify(text)
        kind = next((f.kind for f in found if f.end > len(head)), "other")
        seen[(kind, shape(text, found))] += 1
    return seen.most_common(1)[0][0]


def _decoded(decode, ids: Sequence[int]) -> str:
    try:
        return decode(list(ids))
    except Exception:  # ids the tokenizer does not know: nothing to name
        return ""
