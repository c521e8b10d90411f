"""The prefix_diverged rule and what the reorder is worth: one implementation for the sidecar, the
aggregator and the analyzer. Pure.

A run of new blocks starts at the chain's *divergence point*: the first token after the cached
prefix it extends (the whole prompt at a chain's root). Content is *known* where its anchors'
fingerprints were seen before (fingerprints.py). The rule (docs/kv-events.md, "prefix_diverged"):

- the *known run* is the first stretch of known content in the run of new blocks: from the first
  seen anchor up to the first unseen anchor after it (content that comes back after that is not
  part of it);
- known content at the divergence point that falls short of a whole hit unit, near the prompt's
  start (`near_start`), is the *head*: the tail of a shared head (a chat template's role header, a
  field label) whose unit the per-request content shares. It is skipped: the known run is the first
  one after the unseen content behind it;
- it is *fronted* when per-request content sits between the divergence point and the run: an
  unseen anchor before it, or, at a chain's root, any tokens before it, or, behind a cached
  prefix near the prompt's start, an anchor-free front of a hit unit and more before a run to the
  end (`front_without_anchors`);
- a reorder (per-request fields after the shared part) would serve the whole hit units of a
  fronted known run: `served_tokens`. Those tokens are `prefix_diverged`; the rest stay `cold`.
  Known content at the divergence point itself is not: it is already first (a layout that is
  already fixed, or content that only recurs after unique content: a known stretch of a whole hit
  unit or more at the divergence point ends the search there).
- Known content at the divergence point that falls short of a whole hit unit can never hit:
  `unit_shortfall_tokens` (DeepSeek-V4's 256-token units leave 105 tokens of a 361-token template).
  At a chain's root, known content from the first token that ends short of a unit is that, not a
  fronted run; one unit all seen with a new hash differs where no anchor could see (its last K).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from .fingerprints import ANCHOR_SPACING, K

FRONT_DEPTH_UNITS = 2
# At a chain's root, tokens a per-request front is taken to run past its last anchor (the divergence
# point when it has none) at most: anchor-free content that long is rare (one anchor in 16 tokens), and
# a known run's first seen anchor can lie much later where anchors are sparse.
FRONT_TAIL = 3 * ANCHOR_SPACING  # 2 cuts a timestamp front in two (docs/kv-events.md)
# Past the front's last anchor, where it has one: its tail then is what follows that anchor only (the seed's
# header's longest is 27 tokens; docs/kv-events.md)
FRONT_TAIL_BEHIND_ANCHOR = 2 * ANCHOR_SPACING


class KnownRun(NamedTuple):
    start: int  # first token of the known run in the run of new blocks (estimate)
    end: int  # the token after it (estimate)
    fronted: bool  # per-request content sits between the divergence point and the run
    head: int = 0  # known tokens at the divergence point skipped before it (short of a hit unit)


def first_known_run(
    positions: Sequence[int],
    seen: list[bool],
    length: int,
    root: bool,
    unit: int = 0,
    depth: int | None = None,
    fresh_start: bool = False,
    open_tail: int = 0,
) -> KnownRun | None:
    """The first known run of `length` new tokens whose anchors sit at `positions` (ascending, all
    below `length`) and were `seen` before; None when no anchor was seen. `root`: the tokens start
    a chain (no parent block), so whatever precedes the run is the prompt's own front part. A run
    at the divergence point shorter than `unit` tokens is the head: the next known run is returned,
    with the head's length (none after it: the head itself). `depth`: tokens of the cached prefix
    before the new ones (None: unknown). `fresh_start`: at a root, the chain's first tokens were never
    seen as a chain's start (fingerprints.prefix_prints): one unit all seen yet new differs at its
    front, not in its last K tokens. `open_tail`: at a root, unseen content only within that many tokens
    of the end does not end a fronted run (an earlier prompt's tail it never stored: docs/kv-events.md).

    The run starts `lead` tokens before its first seen anchor (never at or before the unseen
    anchor preceding it; at a root, at most FRONT_TAIL_BEHIND_ANCHOR tokens after it, or FRONT_TAIL
    after the divergence point when no anchor precedes it: a per-request front is short) and ends
    K / 2 tokens into the first unseen anchor's window after it (at least K tokens past its last seen
    anchor: that window was known whole)."""
    if True not in seen:
        return None
    first = seen.index(True)
    run = _run_from(positions, seen, length, root, first, unit, depth, fresh_start, open_tail)
    if run.fronted or run.end >= unit or not near_start(root, depth, unit):
        return run
    after = next((i for i in range(first + 1, len(seen)) if not seen[i]), len(seen))
    behind = next((i for i in range(after + 1, len(seen)) if seen[i]), None)  # past the unseen content
    return (
        run
        if behind is None
        else _run_from(positions, seen, length, root, behind, unit, depth, open_tail=open_tail)._replace(
            head=run.end
        )
    )


def _run_from(
    positions: Sequence[int],
    seen: list[bool],
    length: int,
    root: bool,
    first: int,
    unit: int,
    depth: int | None,
    fresh_start: bool = False,
    open_tail: int = 0,
) -> KnownRun:
    after = next((i for i in range(first + 1, len(seen)) if not seen[i]), None)
    floor = positions[first - 1] + 1 if first else 0
    start = max(floor, positions[first] - lead(positions, length))
    if root:
        start = min(start, floor + (FRONT_TAIL_BEHIND_ANCHOR if first else FRONT_TAIL))
    end = length if after is None else min(max(positions[after - 1] + K, positions[after] + K // 2), length)
    fronted = first > 0 or ((root or after is None) and front_without_anchors(start, root, unit, depth))
    if root and not first and unit > 0:
        if after is None and length <= unit and not fresh_start:  # one unit all seen, its hash new
            end = min(max(positions[-1] + K, unit - K), length)
        if end < unit:  # short of a unit: whatever came before it, it can never hit
            fronted = False
    tail = after is not None and length - positions[after] < open_tail and True not in seen[after:]
    if root and fronted and tail:  # the earlier prompt's unstored tail, shifted in by a shorter front
        end = length
    return KnownRun(start, max(end, start), fronted)


def lead(positions: Sequence[int], length: int) -> int:
    """Tokens a known run is estimated to start before its first seen anchor: a quarter of the
    anchor spacing; the event's own (tokens per anchor) where it is at least twice the typical one
    (ids below 512 have one byte that can select them: a text of few distinct ids may hold few)."""
    spacing = length // max(len(positions), 1)
    return (spacing if spacing >= 2 * ANCHOR_SPACING else ANCHOR_SPACING) // 4


def front_without_anchors(start: int, root: bool, unit: int, depth: int | None = None) -> bool:
    """Whether the tokens before a known run's `start`, with no anchor among them, are its
    per-request front: at a chain's root any (the first block's hash is new, so it differs from
    every prompt before); behind a cached prefix, for a run that reaches the end of the new tokens,
    a hit unit plus three quarters of an anchor spacing or more (at typical spacing: had the known
    content begun a whole spacing before its first anchor, a unit would still precede it). A field
    of small ids such as digits may hold no anchor at all, while known content at the divergence
    point mostly shows one sooner. A run that ends before the new tokens do needs an unseen anchor
    before it there: recurring pieces after a unique header do not count. Behind a cached prefix the
    anchor-free front counts only near the prompt's start (a `depth` of at most FRONT_DEPTH_UNITS hit
    units, where fields placed first sit, after a shared role header): behind a long shared part, a
    unique middle followed by content that recurs is not a field order to fix."""
    if root:
        return start > 0
    return near_start(root, depth, unit) and 0 < unit <= start - ANCHOR_SPACING * 3 // 4


def near_start(root: bool, depth: int | None, unit: int) -> bool:
    """Whether the divergence point lies where fields placed first sit: within FRONT_DEPTH_UNITS hit
    units of the prompt's start (behind at most a shared role header). Only there is a short known
    head skipped or an anchor-free front credited."""
    return root or (depth is not None and depth <= FRONT_DEPTH_UNITS * unit)


def served_tokens(
    run: KnownRun | None, length: int, unit: int, continues: bool = False, tail: int = 0
) -> int:
    """Tokens of the `length` new ones a reorder would have served: the whole hit units of `run`
    once the per-request front is moved after it. `continues`: the tokens extend a chain whose
    known run reached its end (the run goes on from token 0, no front needed). `tail`: tokens a run
    that reaches the end goes on into past the new ones (a prompt's last, partial block is never
    stored: half a block on average); the front moved to the end gives them room."""
    if run is None or unit <= 0 or not (run.fronted or continues) or (continues and run.head):
        return 0  # a chain continuing its head: the head is short of a unit
    start = run.start if run.fronted else 0
    known = run.end - start + (tail if run.end >= length else 0)
    return min(known // unit * unit, length)


def served_span(run: KnownRun, length: int, served: int) -> tuple[int, int]:
    """Where the served tokens sit among the new ones: from the run's start (0 when it continues a
    chain), moved back where the tail made the run longer than what is left after its start."""
    start = run.start if run.fronted else 0
    start = min(start, length - served)
    return start, start + served


def unit_shortfall_tokens(run: KnownRun | None, unit: int, continues: bool = False) -> int:
    """Known tokens at the divergence point that were computed because they fall short of a whole
    hit unit (the rest of the unit is per-request content): shared content that can never hit."""
    if run is None or continues:
        return 0
    if run.head:
        return run.head
    return 0 if run.fronted or run.end >= unit else run.end


def overlaps(start: int, stop: int, size: int, count: int) -> list[int]:
    """Per block of `size` tokens (of `count`): how many of tokens [start, stop) it holds."""
    return [max(min(stop, (b + 1) * size) - max(start, b * size), 0) for b in range(count)]


def reordered_hit_ratio(hit_tokens: float, query_tokens: float, diverged_tokens: float) -> float | None:
    """The hit ratio had the per-request fields come after the shared part: the prefix_diverged
    tokens would have hit. None without queries, or above 1 (more attributed than queried: a fault,
    never clipped into a healthy-looking ratio)."""
    if query_tokens <= 0:
        return None
    ratio = max((hit_tokens + diverged_tokens) / query_tokens, 0.0)
    return ratio if ratio <= 1.0 else None
