"""Prefix structure of a trace: shared prefixes, unique first blocks, the dynamic field."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from .trace import TraceRequest

GRAM = 8
"""Token n-gram used to find a shared template that does not start at token 0."""
TEMPLATE_SHARE = 0.3
"""An n-gram in at least this share of the requests is part of a shared template."""


@dataclass
class SharedPrefix:
    tokens: int
    requests: int
    head: list[int]
    """the first tokens of the prefix"""


@dataclass
class DynamicField:
    start: int
    """first token position where requests differ (tokens before it are identical in all of them)"""
    end: int
    """last token position of the dynamic part (the largest template offset minus one)"""
    median_len: float
    template_tokens: int
    """how many tokens the requests share right after the dynamic part"""
    requests: int
    """requests with this layout"""


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


def shared_prefixes(prompts: Sequence[Sequence[int]], min_requests: int, top: int = 5) -> list[SharedPrefix]:
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
    result = [
        SharedPrefix(length, rows, list(ordered[left][: min(length, 12)]))
        for (length, left), rows in found.items()
    ]
    result.sort(key=lambda p: (-p.tokens * p.requests, -p.tokens))
    return result[:top]


def _template_offsets(prompts: Sequence[Sequence[int]]) -> tuple[list[int | None], set[tuple[int, ...]]]:
    """Per prompt, where its first frequent n-gram starts (None: no shared template in it)."""
    seen: Counter[tuple[int, ...]] = Counter()
    for p in prompts:
        seen.update({tuple(p[i : i + GRAM]) for i in range(len(p) - GRAM + 1)})
    threshold = max(2, int(TEMPLATE_SHARE * len(prompts)))
    frequent = {g for g, n in seen.items() if n >= threshold}
    offsets: list[int | None] = []
    for p in prompts:
        offsets.append(
            next((i for i in range(len(p) - GRAM + 1) if tuple(p[i : i + GRAM]) in frequent), None)
        )
    return offsets, frequent


def _template_run(prompt: Sequence[int], offset: int, frequent: set[tuple[int, ...]]) -> int:
    end = offset
    while end + GRAM <= len(prompt) and tuple(prompt[end : end + GRAM]) in frequent:
        end += 1
    return end - offset + GRAM - 1


def dynamic_field(prompts: Sequence[Sequence[int]], block_size: int) -> DynamicField | None:
    """A per-request dynamic part in front of a template most requests share: positions and lengths."""
    offsets, frequent = _template_offsets(prompts)
    late = [(p, o) for p, o in zip(prompts, offsets, strict=True) if o is not None and o > 0]
    if len(late) < max(2, len(prompts) // 2):
        return None
    heads = [list(p[:o]) for p, o in late]
    start = min(_lcp(heads[0], h) for h in heads[1:]) if len(heads) > 1 else 0
    lengths = [o for _, o in late]
    runs = [_template_run(p, o, frequent) for p, o in late]
    return DynamicField(
        start, max(lengths) - 1, statistics.median(lengths), int(statistics.median(runs)), len(late)
    )


def structure(requests: Sequence[TraceRequest], block_size: int) -> Structure:
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
    return Structure(
        len(prompts),
        unique / with_block if with_block else 0.0,
        shared_prefixes(prompts, max(2, len(prompts) // 20)),
        dynamic_field(prompts, block_size),
        lost / total if total else 0.0,
    )
