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

from bisect import bisect_left
from collections.abc import Sequence
from itertools import compress, pairwise, repeat
from operator import is_, ne

from .fingerprints import K

LAYOUTS = ("end", "after_template")
# What `AnchorOrder` keeps per anchor pair: the anchor that followed it, or one of these.
_BRANCH = -1  # followed by more than one anchor: requests went their own ways there
_END = -2  # an event's last pair: nothing after it seen yet
REMEMBER_FROM = 16  # anchors: a shorter sequence is keyed and looked up again faster than its digest


def pair_keys(prints: Sequence[int]) -> list[int]:
    """One key per pair of consecutive anchors (an anchor in the context of the one before it): the
    pair's hash, at C speed (the fastest of the order-keeping combinations measured)."""
    return list(map(hash, pairwise(prints)))


# An event's anchors as `AnchorOrder.read` reads them, once per event for both the walk and learning:
# (the fingerprints, their pair_keys, each key's follower in the new generation or None where the sequence
# was learned already (not looked up), the sequence's digest). A plain tuple: built once per event.
Pairs = tuple[list[int], list[int], list | None, int]


class AnchorOrder:
    """Which anchor followed which pair of anchors, in the stored stream: a map from pair keys, bounded
    as two generations (fingerprints.Generations' scheme).

    A learned sequence of `remember_from` anchors or more is remembered (its digest and keys, up to
    `remembered` keys in all, forgotten when the generations turn): while every one of its pairs is in
    the new generation, learning it again changes nothing (a pair's follower only ever goes from none to
    the end mark to an anchor to a branch point), so an event that repeats one is neither keyed nor
    looked up again."""

    def __init__(self, bound: int, remembered: int | None = None, remember_from: int = REMEMBER_FROM) -> None:
        self.half = max(bound // 2, 1)
        self.new: dict[int, int] = {}
        self.old: dict[int, int] = {}
        self.remembered = self.half // 4 if remembered is None else remembered
        self.remember_from = remember_from
        self._learned: dict[int, list[int]] = {}  # digest -> keys: sequences learned in this generation
        self._learned_keys = 0

    def __len__(self) -> int:
        return len(self.new) + len(self.old)

    def read(self, prints: list[int]) -> Pairs:
        """An event's anchors, before the walk and learning them."""
        digest = None
        if len(prints) >= self.remember_from:
            digest = hash(tuple(prints))
            keys = self._learned.get(digest)
            if keys is not None:
                return prints, keys, None, digest
        keys = list(map(hash, pairwise(prints)))  # pair_keys, inline: this runs once an event
        return prints, keys, list(map(self.new.get, keys)), digest

    def learn(self, pairs: Pairs) -> None:
        """Remember an event's anchors in order (after reading it: an event never matches itself)."""
        prints, keys, before, digest = pairs
        if before is None or not keys:
            return
        new, old = self.new, self.old
        after = prints[2:]
        after.append(_END if before[-1] is None else before[-1])  # the last pair keeps a follower it had
        if before != after:  # (equal: every pair known with this follower, the common case: no change)
            changed = list(compress(before, map(ne, before, after)))  # what those pairs were followed by
            unknown = changed.count(None)
            if old:
                self._merge(keys, before, after)
            elif unknown == len(changed):  # only new pairs: the others are rewritten with what they hold
                new.update(zip(keys, after, strict=True))
            elif unknown + changed.count(_BRANCH) == len(changed):  # new pairs and branch points: add
                new.update(compress(zip(keys, after, strict=True), map(is_, before, repeat(None))))
            else:
                self._merge(keys, before, after)
        if len(new) >= self.half:
            self.old, self.new = new, {}
            self._learned, self._learned_keys = {}, 0
        elif digest is not None and self._learned_keys + len(keys) <= self.remembered:
            self._learned[digest] = keys
            self._learned_keys += len(keys)

    def _merge(self, keys: list[int], before: list, after: list) -> None:
        """Put an event's pairs, a pair that was followed by another anchor before becoming a branch."""
        new, old = self.new, self.old
        fresh = dict(zip(keys, after, strict=True))
        if old and None in before:
            before = [b if b is not None else old.get(k) for b, k in zip(before, keys, strict=True)]
        for key, was in zip(keys, before, strict=True):
            if was is None or was == fresh[key]:
                continue
            if was == _BRANCH or fresh[key] == _END:  # a follower other than before: rare
                fresh[key] = was
            elif was != _END:
                fresh[key] = _BRANCH
        new.update(fresh)

    def reached(self, pairs: Pairs, first: int) -> tuple[int, int]:
        """From anchor `first`: (the last anchor reached in order, the first branch point on the way or
        that last one when there is none)."""
        new, old = self.new, self.old
        _, keys, looked, _ = pairs
        followers = list(map(new.get, keys[first:])) if looked is None else looked[first:]
        if old and None in followers:
            tail = keys[first:]
            followers = [f if f is not None else old.get(k) for f, k in zip(followers, tail, strict=True)]
        if None in followers:
            del followers[followers.index(None) :]
        steps = len(followers)
        return first + steps, first + (followers.index(_BRANCH) + 1 if _BRANCH in followers else steps)


def stop_after(positions: Sequence[int], last: int, length: int) -> int:
    """Where content reached up to anchor `last` ends: K / 2 into the next anchor's window, at least
    K past `last`'s (reorder.py's rule for a known run's end); the end of the tokens after the last."""
    if last + 1 >= len(positions):
        return length
    return min(max(positions[last] + K, positions[last + 1] + K // 2), length)


def layout_served(
    order: AnchorOrder,
    positions: Sequence[int],
    pairs: Pairs,
    span: tuple[int, int],
    run_start: int,
    unit: int,
    length: int,
) -> tuple[int, int]:
    """(end, after_template): the tokens of the served `span` (start, stop) a reorder to each layout would
    hit, in whole hit units from the span's start; the walk starts at the first anchor of the known run
    (from `run_start`: the span may start before it, where the run's tail made it longer). `pairs`: the
    event's anchors as `order` read them."""
    start, stop = span
    first = bisect_left(positions, run_start)
    if first >= len(positions) or unit <= 0:
        return 0, 0
    last, branch = order.reached(pairs, first)
    last, branch = min(last, len(positions) - 1), min(branch, len(positions) - 1)  # anchors cut: hostile
    end = min(stop_after(positions, last, length), stop) if last + 1 < len(positions) else stop
    template = min(stop_after(positions, branch, length), end)
    return (end - start) // unit * unit, max(template - start, 0) // unit * unit
