"""Where each prompt's per-request part sits, and the prompts with it moved after the shared part. Pure.

A prompt's layout is three spans: the *head* (the longest prefix at least half of the requests share: a
chat template's role header, a field label such as `Time: 2026-12-03T`), the *dynamic* part (from the head's
end to the start of the template), and the *template* (the first run, at least one hit unit long, of
content frequent in the trace: 8-token n-grams found in at least 30% of the requests). The chat template's
own role header is shared by every request, so it is the head, never the template: a timestamp or a
customer id right after it is the dynamic part. The reorder keeps the head, then everything after the
dynamic part, then the dynamic part: per-request fields moved to the very end. `reorder_after_template`
puts them right after the template instead (before a per-request question): where content after the
template recurs (questions asked again), the two layouts hit differently.

`reordered_prompts` is the seam the sidecar's estimator plugs into (derive: the same rule for live and
offline); the analyzer replays its output exactly to say what the reorder is worth.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ..derive.reorder import reordered_hit_ratio

GRAM = 8
"""Token n-gram used to find shared content that does not start at token 0."""
TEMPLATE_SHARE = 0.3
"""An n-gram in at least this share of the requests is shared content."""
HEAD_SHARE = 0.5
"""A prefix at least this share of the requests has is the shared head (role header, field label)."""


@dataclass(frozen=True)
class Layout:
    head: int
    """tokens before the dynamic part"""
    template: int
    """where the shared content after the dynamic part starts"""
    template_end: int


@dataclass
class DynamicField:
    start: int
    """the shortest head: the first token position where these requests differ"""
    end: int
    """last token position of the longest dynamic part"""
    median_len: float
    """median position where the shared content starts (head and dynamic part before it)"""
    template_tokens: int
    """median length of the shared content right after the dynamic part"""
    requests: int
    """requests with this layout"""
    field: str | None = None
    """the kind of the first per-request field (derive/fields.py), when the trace can be decoded"""
    shape: str | None = None
    """the redacted shape of the most common per-request part"""


def frequent_grams(prompts: Sequence[Sequence[int]]) -> set[tuple[int, ...]]:
    seen: Counter[tuple[int, ...]] = Counter()
    for p in prompts:
        seen.update({tuple(p[i : i + GRAM]) for i in range(len(p) - GRAM + 1)})
    threshold = max(2, int(TEMPLATE_SHARE * len(prompts)))
    return {g for g, n in seen.items() if n >= threshold}


def covered_runs(prompt: Sequence[int], frequent: set[tuple[int, ...]]) -> Iterator[tuple[int, int]]:
    """[start, end) spans of the prompt covered by frequent n-grams, in order (lazily: callers stop early)."""
    run = None
    for i in range(len(prompt) - GRAM + 1):
        if tuple(prompt[i : i + GRAM]) in frequent:
            if run is not None and run[1] >= i:
                run = (run[0], i + GRAM)
                continue
            if run is not None:
                yield run
            run = (i, i + GRAM)
    if run is not None:
        yield run


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n, i = min(len(a), len(b)), 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def shared_heads(prompts: Sequence[Sequence[int]], share: float = HEAD_SHARE) -> list[int]:
    """Per prompt, the longest prefix it has in common with at least `share` of the prompts (0: none)."""
    need = max(2, math.ceil(share * len(prompts)))
    order = sorted(range(len(prompts)), key=lambda i: tuple(prompts[i]))
    lcps = [_lcp(prompts[a], prompts[b]) for a, b in itertools.pairwise(order)]
    heads = [0] * len(prompts)
    # LCP intervals (a stack over the sorted prompts); those holding `need` rows are nested: assign
    # the shallow ones first so the deeper (longer) ones win.
    found: list[tuple[int, int, int]] = []
    stack: list[tuple[int, int]] = []
    for i, h in enumerate([*lcps, 0]):
        left = i
        while stack and stack[-1][0] > h:
            length, left = stack.pop()
            if i + 1 - left >= need:
                found.append((length, left, i))
        if not stack or stack[-1][0] < h:
            stack.append((h, left))
    for length, left, right in sorted(found):
        for row in order[left : right + 1]:
            heads[row] = length
    return heads


def layouts(prompts: Sequence[Sequence[int]], unit: int) -> list[Layout | None]:
    """Each prompt's layout, None where no shared content of at least `unit` tokens follows a dynamic
    part."""
    frequent = frequent_grams(prompts)
    out: list[Layout | None] = []
    for prompt, head in zip(prompts, shared_heads(prompts), strict=True):
        found = None
        for start, end in covered_runs(prompt, frequent):
            start = max(start, head)
            if end - start >= unit:
                found = Layout(head, start, end) if start > head else None
                break
        out.append(found)
    return out


def reorder(prompt: Sequence[int], layout: Layout | None) -> list[int]:
    """The prompt with its dynamic part moved after the rest."""
    if layout is None:
        return list(prompt)
    h, t = layout.head, layout.template
    return [*prompt[:h], *prompt[t:], *prompt[h:t]]


def reorder_after_template(prompt: Sequence[int], layout: Layout | None) -> list[int]:
    """The prompt with its dynamic part moved right after the shared template (before what follows it,
    such as a per-request question): the other layout a fix can take."""
    if layout is None:
        return list(prompt)
    h, t, e = layout.head, layout.template, layout.template_end
    return [*prompt[:h], *prompt[t:e], *prompt[h:t], *prompt[e:]]


def reordered_prompts(prompts: Sequence[Sequence[int]], unit: int) -> list[list[int]]:
    return [reorder(p, lay) for p, lay in zip(prompts, layouts(prompts, unit), strict=True)]


def dynamic_field(found: Sequence[Layout | None]) -> DynamicField | None:
    moved = [lay for lay in found if lay is not None]
    if len(moved) < 2:
        return None
    return DynamicField(
        min(lay.head for lay in moved),
        max(lay.template for lay in moved) - 1,
        statistics.median(lay.template for lay in moved),
        int(statistics.median(lay.template_end - lay.template for lay in moved)),
        len(moved),
    )


def live_estimate(hit_tokens: int, prompt_tokens: int, diverged_tokens: int) -> float | None:
    """The sidecar's estimate of the reorder's worth (derive/reorder.py: the prefix_diverged tokens would
    have hit); the exact replay of `reordered_prompts` is its offline check."""
    return reordered_hit_ratio(hit_tokens, prompt_tokens, diverged_tokens)
