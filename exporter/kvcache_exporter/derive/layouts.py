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

Served on a budget (`OrderBudget`, --kv-events.reorder-per-second): the anchor order is read, walked and
learnt for at most so many stored events a second; attribution takes the rest as with the order off.
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Callable, Sequence
from itertools import compress, pairwise, repeat
from operator import eq, is_, ne

from .fingerprints import K, newest

log = logging.getLogger(__name__)

LAYOUTS = ("end", "after_template")
# What `AnchorOrder` keeps per anchor pair: the anchor that followed it, or one of these.
_BRANCH = -1  # followed by more than one anchor: requests went their own ways there
_END = -2  # an event's last pair: nothing after it seen yet
_NEW, _NEW_OR_BRANCH = frozenset((None,)), frozenset((None, _BRANCH))  # what pairs that learning adds held
REMEMBER_FROM = 16  # anchors: a shorter sequence is keyed and looked up again faster than its digest
BURST_SECONDS = 10.0  # of unused budget saved: a poll hands over its interval's events at once
LOG_EVERY_S = 60.0  # one line at most while events go past the budget


def refilled(left: float, rate: float, elapsed: float, most: float) -> float:
    """A token bucket's tokens after `elapsed` seconds at `rate` a second, at most `most`."""
    return min(left + rate * max(elapsed, 0.0), most)


class OrderBudget:
    """At most `per_second` stored events a second the anchor order reads, walks and learns, with up to
    BURST_SECONDS of them saved (a token bucket, on `clock`); `ordered` and `skipped` count them. One
    per stream (`Attribution(order_budget=...)`), or one across the bench's passes, as one stream has."""

    def __init__(self, per_second: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.most, self.clock = per_second, per_second * BURST_SECONDS, clock
        self.left, self.at = self.most, clock()
        self.due = self.at if self.most >= 1.0 else float("inf")  # when the next token is there
        self.ordered = self.skipped = 0
        self._logged, self._logged_skipped = float("-inf"), 0

    def take(self) -> bool:
        """Whether the next event gets the anchor order (one token spent when it does)."""
        now = self.clock()
        if now < self.due:  # (past the budget, the common case then: one comparison)
            self.skipped += 1
            return False
        if self.skipped > self._logged_skipped and now - self._logged >= LOG_EVERY_S:
            self._logged, self._logged_skipped = now, self.skipped
            extra = {"per_second": self.rate, "ordered": self.ordered, "skipped": self.skipped}
            log.info(
                "events past the reorder estimate's budget, estimated at the ordered ones' rate", extra=extra
            )
        left = refilled(self.left, self.rate, now - self.at, self.most) - 1.0
        self.left, self.at, self.ordered = left, now, self.ordered + 1
        if left < 1.0:
            self.due = now + (1.0 - left) / self.rate
        return True


def pair_keys(prints: Sequence[int]) -> list[int]:
    """One key per pair of consecutive anchors (an anchor in the context of the one before it): the
    pair's hash, at C speed (the fastest of the order-keeping combinations measured)."""
    return list(map(hash, pairwise(prints)))


# An event's anchors as `AnchorOrder.read` reads them, once per event for the rules, the walk and learning:
# [the fingerprints, their pair_keys, each key's follower in the new generation or None where the sequence
# was learned already (not looked up), the sequence's digest, each key's follower in either generation
# (None until the rules or the walk first ask)]. A plain list: built once per event.
Pairs = list


class AnchorOrder:
    """Which anchor followed which pair of anchors, in the stored stream: a map from pair keys, bounded
    as two generations (fingerprints.Generations' scheme).

    A learned sequence of `remember_from` anchors or more is remembered (its digest and keys, up to
    `remembered` keys in all, forgotten when the generations turn): while every one of its pairs is in
    the new generation, learning it again changes nothing (a pair's follower only ever goes from none to
    the end mark to an anchor to a branch point), so an event that repeats one is neither keyed nor
    looked up again. Its followers are looked up when it is first repeated and kept with it, good until
    a pair that had a follower gets another (only `_merge` does that: it counts `merges`)."""

    def __init__(self, bound: int, remembered: int | None = None, remember_from: int = REMEMBER_FROM) -> None:
        self.half = max(bound // 2, 1)
        self.new: dict[int, int] = {}
        self.old: dict[int, int] = {}
        self.remembered = self.half // 4 if remembered is None else remembered
        self.remember_from = remember_from
        # digest -> (keys, their followers or None until looked up, merges then): sequences learned in this
        # generation
        self._learned: dict[int, tuple[list[int], list | None, int]] = {}
        self._learned_keys = 0
        self.merges = 0

    def __len__(self) -> int:
        return len(self.new) + len(self.old)

    def read(self, prints: list[int]) -> Pairs:
        """An event's anchors, before the walk and learning them."""
        digest = None
        if len(prints) >= self.remember_from:
            digest = hash(tuple(prints))
            learned = self._learned.get(digest)
            if learned is not None:
                return [prints, learned[0], None, digest, None]
        keys = list(map(hash, pairwise(prints)))  # pair_keys, inline: this runs once an event
        looked = list(map(self.new.get, keys))
        return [prints, keys, looked, digest, None if self.old else looked]  # (no old one: the followers)

    def followers(self, pairs: Pairs) -> list:
        """Each pair's follower in either generation (None: never seen), once an event."""
        walk = pairs[4]
        if walk is None:
            keys, walk = pairs[1], pairs[2]
            if walk is None:  # a remembered sequence: its followers as looked up, unless merges came since
                learned = self._learned.get(pairs[3])
                if learned is not None and learned[1] is not None and learned[2] == self.merges:
                    walk = learned[1]
                else:
                    walk = list(map(self.new.get, keys))
                    if learned is not None:  # looked up when first repeated: most sequences never are
                        self._learned[pairs[3]] = keys, walk, self.merges
            if self.old and None in walk:
                old = self.old.get
                walk = [f if f is not None else old(k) for f, k in zip(walk, keys, strict=True)]
            pairs[4] = walk
        return walk

    def steps(self, pairs: Pairs, first: int, seen: list[bool]) -> list[bool]:
        """Per step from an anchor to the next, from anchor `first` on (False before it): whether it
        was seen before in that order, in context (the pair of the anchor and the one before it was
        followed by the next; the first step and the one after an unseen anchor or a new pair: the
        pair was seen).
        A pair followed by several anchors (requests going their own ways, sections seen in more than
        one order) is in order for none."""
        walk, prints = self.followers(pairs), pairs[0]
        last = min(len(prints), len(seen)) - 1  # steps first .. last - 1 (seen: anchors inside the event)
        if first >= last:
            return [False] * first
        before = walk[first : last - 1]  # the follower of the pair before step i, i from first + 1
        context = seen[first : last - 1]
        if before and before == prints[first + 2 : last + 1] and False not in context:  # all in order
            return [False] * first + [True] * (last - first)
        steps = list(map(eq, before, prints[first + 2 :]))
        if _END in before:
            steps = [step or follower == _END for step, follower in zip(steps, before, strict=True)]
        if None in before:  # after a new pair (a seam) no context either: one seam is not read as two
            context = [c and f is not None for c, f in zip(context, before, strict=True)]
        if False in context:  # after an unseen anchor or a new pair:
            at_all = walk[first + 1 :]  # the pair seen at all
            steps = [s if c else f is not None for s, c, f in zip(steps, context, at_all, strict=True)]
        steps.insert(0, walk[first] is not None)
        return [False] * first + steps if first else steps

    def learn(self, pairs: Pairs) -> None:
        """Remember an event's anchors in order (after reading it: an event never matches itself)."""
        prints, keys, before, digest, _ = pairs
        if before is None or not keys:
            return
        new = self.new
        after = prints[2:]
        after.append(_END if before[-1] is None else before[-1])  # the last pair keeps a follower it had
        if before != after:  # (equal: every pair known with this follower, the common case: no change)
            if self.old and None in before:  # what the old generation's pairs were followed by
                before = self.followers(pairs)
            changed = set(compress(before, map(ne, before, after)))  # what the pairs that differ held
            if not self.old and changed <= _NEW_OR_BRANCH:  # new pairs (and branch points): the new added
                new.update(compress(zip(keys, after, strict=True), map(is_, before, repeat(None))))
            elif changed <= _NEW:  # only new pairs differ: the others are rewritten with what they hold
                new.update(zip(keys, after, strict=True))  # (into the new generation)
            else:
                self._merge(keys, before, after)
        if len(new) >= self.half:
            self.old, self.new = newest(new, self.half), {}
            self._learned, self._learned_keys = {}, 0
        elif digest is not None and self._learned_keys + len(keys) <= self.remembered:
            self._learned[digest] = keys, None, self.merges  # (all in `new` now; followers: when repeated)
            self._learned_keys += len(keys)

    def _merge(self, keys: list[int], before: list, after: list) -> None:
        """Put an event's pairs (`before`: what they were followed by in either generation), a pair that
        was followed by another anchor before becoming a branch."""
        self.merges += 1
        fresh = dict(zip(keys, after, strict=True))
        for key, was in zip(keys, before, strict=True):
            if was is None or was == fresh[key]:
                continue
            if was == _BRANCH or fresh[key] == _END:  # a follower other than before: rare
                fresh[key] = was
            elif was != _END:
                fresh[key] = _BRANCH
        self.new.update(fresh)

    def reached(self, pairs: Pairs, first: int) -> tuple[int, int]:
        """From anchor `first`: (the last anchor reached in order, the first branch point on the way or
        that last one when there is none)."""
        followers = self.followers(pairs)[first:]
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
