"""What a reorder is worth per layout: the per-request fields moved to the very end, or right after the
shared template. Pure, bounded.

The prefix_diverged tokens (reorder.py) are known content behind a per-request front. Content is known
when its anchors were seen anywhere before; a prefix cache hits only content that follows, in order, what
an earlier request had in the same order. A question asked before after other history, or sentences that
questions share, are known but would not hit: counting them ran the estimate high. So each layout's worth
is the part of the served span reached *in order*:

- `end` (fields after everything shared): from the run's first anchor, while each next anchor was seen
  right after the one before it (an anchor pair seen before);
- `after_template` (fields between the shared template and what follows it, such as the question): the
  same, and only up to the first *branch point*, an anchor seen followed by two different anchors (in
  the context of the anchor before it: a phrase a template repeats is no branch): where requests that
  share a template go their own ways.

Both stop where `_run_from` ends a known run (reorder.py): K / 2 tokens into the window of the first anchor
not reached, at least K past the last one reached; both count whole hit units from the run's start.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import pairwise

from .fingerprints import FingerprintSet, Generations, K

LAYOUTS = ("end", "after_template")
_BRANCH = -1  # in `following`: the anchor was followed by more than one anchor


class AnchorOrder:
    """Which anchor followed which, in the stored stream: pairs seen, and branch points. Bounded."""

    def __init__(self, bound: int) -> None:
        self.pairs = FingerprintSet(bound)
        self.following = Generations(bound)

    def __len__(self) -> int:
        return len(self.pairs) + len(self.following)

    def learn(self, prints: Sequence[int]) -> None:
        """Remember an event's anchors in order (after reading it: an event never matches itself)."""
        if len(prints) < 2:
            return
        pairs, following = self.pairs, self.following
        keys = [hash(pair) for pair in pairwise(prints)]
        pairs.update(keys)  # (also the key of what follows the pair's second anchor: its context)
        for before, after in zip(keys, prints[2:], strict=False):
            seen = following.get(before)
            if seen is None:
                following.put(before, after)
            elif seen != after and seen != _BRANCH:
                following.put(before, _BRANCH)

    def reached(self, prints: Sequence[int], first: int) -> tuple[int, int]:
        """From anchor `first`: (the last anchor reached in order, the first branch point on the way or
        that last one when there is none)."""
        pairs, following = self.pairs, self.following
        last, branch = first, None
        while last + 1 < len(prints) and (key := hash((prints[last], prints[last + 1]))) in pairs:
            last += 1
            if branch is None and following.get(key) == _BRANCH:
                branch = last
        return last, last if branch is None else branch


def stop_after(positions: Sequence[int], last: int, length: int) -> int:
    """Where content reached up to anchor `last` ends: K / 2 into the next anchor's window, at least
    K past `last`'s (reorder.py's rule for a known run's end); the end of the tokens after the last."""
    if last + 1 >= len(positions):
        return length
    return min(max(positions[last] + K, positions[last + 1] + K // 2), length)


def layout_served(
    order: AnchorOrder,
    positions: Sequence[int],
    prints: Sequence[int],
    span: tuple[int, int],
    run_start: int,
    unit: int,
    length: int,
) -> tuple[int, int]:
    """(end, after_template): the tokens of the served `span` (start, stop) a reorder to each layout would
    hit, in whole hit units from the span's start; the walk starts at the first anchor of the known run
    (from `run_start`: the span may start before it, where the run's tail made it longer)."""
    start, stop = span
    first = next((i for i, p in enumerate(positions) if p >= run_start), None)
    if first is None or unit <= 0:
        return 0, 0
    last, branch = order.reached(prints, first)
    end = min(stop_after(positions, last, length), stop) if last + 1 < len(positions) else stop
    template = min(stop_after(positions, branch, length), end)
    return (end - start) // unit * unit, max(template - start, 0) // unit * unit
