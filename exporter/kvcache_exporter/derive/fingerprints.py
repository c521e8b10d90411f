"""Content fingerprints of token runs that do not depend on block alignment, and bounded stores. Pure.

The rule (docs/kv-events.md, "Miss attribution"): the token ids are laid out as 4-byte
little-endian words; token t is an *anchor* when the low byte of its id is one of the SELECTED
values (a sixteenth of the values 4-255, picked by a fixed multiplicative hash). An anchor's
fingerprint is the hash of the K tokens that start there (anchors with fewer than K tokens left
are skipped). Anchors are chosen by content, so the same text yields the same fingerprints wherever
it sits: text shifted by a varying-length front field still matches. About one token in 16 is an
anchor whatever the vocabulary (the low byte varies in every one; testing every byte of the word
made large vocabularies twice as dense and their attribution a quarter slower). Finding them is a
strided slice, `bytes.translate` and `bytes.find` (C speed); only anchors cost Python work.
Fingerprints are Python's bytes hash,
salted per process: they are compared within one exporter only.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from functools import cache
from itertools import islice

K = 8  # tokens per fingerprint: long enough that random 8-token matches are rare
_MULT = 0x9E3779B1  # Knuth's multiplicative hash: spreads neighbouring values
SELECTED = frozenset(v for v in range(4, 256) if ((v * _MULT) & 0xFFFFFFFF) >> 28 == 0)
_MASK = bytes(1 if v in SELECTED else 0 for v in range(256))
ANCHOR_SPACING = 16  # tokens between anchors, typically
_WIDTH = K * 4  # bytes fingerprinted from an anchor


def _words(tokens: Sequence[int]) -> bytes:
    try:
        return array("I", tokens).tobytes()
    except (OverflowError, TypeError):  # ids outside 0..2^32-1 (hostile): fold them in
        return array("I", [int(t) & 0xFFFFFFFF for t in tokens]).tobytes()


def anchors(tokens: Sequence[int]) -> tuple[list[int], list[int]]:
    """The token positions of every anchor of `tokens` with K tokens to fingerprint, and their
    fingerprints, as two lists (positions ascending)."""
    words = _words(tokens)
    find, end = words[::4].translate(_MASK).find, max(len(tokens) - K + 1, 0)  # the low bytes
    positions: list[int] = []
    prints: list[int] = []
    at = find(1, 0, end)
    while at >= 0:  # one loop for both lists: the fewest Python steps per anchor
        positions.append(at)
        prints.append(hash(words[at * 4 : at * 4 + _WIDTH]))
        at = find(1, at + 1, end)
    return positions, prints


PREFIX_STEPS = 16  # prefix lengths a chain's start is remembered at, per hit unit


@cache
def prefix_lengths(unit: int) -> tuple[int, ...]:
    """The lengths a chain's first tokens are remembered at (docs/kv-events.md, "below_hit_unit"):
    from K up to the hit unit (excluded) in sixteenths of it; at most PREFIX_STEPS a chain."""
    step = max(unit // PREFIX_STEPS, 1)
    return tuple(range(-(-K // step) * step, unit, step))


def prefix_prints(tokens: Sequence[int], unit: int) -> tuple[tuple[int, ...], list[int]]:
    """(lengths, fingerprints) of `tokens`' prefixes at prefix_lengths(unit) (those it holds). Shared
    content shorter than K anchors cannot be told apart from a template's role header."""
    lengths = prefix_lengths(unit)
    if lengths and lengths[-1] > len(tokens):
        lengths = tuple(n for n in lengths if n <= len(tokens))
    if not lengths:
        return lengths, []
    words = _words(tokens[: lengths[-1]])
    return lengths, [hash(words[: n * 4]) for n in lengths]


def shared_prefix(lengths: Sequence[int], prints: Sequence[int], seen: FingerprintSet) -> int:
    """The longest of `lengths` whose prefix fingerprint was `seen` (prefixes: a longer one seen means
    every shorter one was); 0 when none."""
    shared = 0
    for length, print_ in zip(lengths, prints, strict=True):
        if print_ not in seen:
            break
        shared = length
    return shared


def anchored_prints(tokens: Sequence[int]) -> list[tuple[int, int]]:
    """(token position, fingerprint) of every anchor of `tokens` with K tokens to fingerprint."""
    return list(zip(*anchors(tokens), strict=True))


def newest(entries, half: int):
    """`entries` cut to at most `half` in place, the first put going first where they have an order: a
    bulk update (one event of more blocks or anchors than the half) puts more before it rotates. Costs
    the overshoot, not the half: a rotation stays cheap."""
    over = len(entries) - half
    if over > 0:
        if isinstance(entries, dict):
            for key in list(islice(entries, over)):
                del entries[key]
        else:
            for _ in range(over):
                entries.pop()
    return entries


class Generations:
    """A bounded map kept as two generations: the newest half and the one before it.

    When the new generation fills half the bound, the old one is dropped and the new one becomes
    old: a cheap approximation of LRU (an entry put again lives in the new generation), O(1) per
    operation, never more than `bound` entries.
    """

    def __init__(self, bound: int):
        self.half = max(bound // 2, 1)
        self.new: dict[Hashable, int] = {}
        self.old: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self.new) + len(self.old)

    def get(self, key: Hashable) -> int | None:
        """The value, from the new generation first; callers put() what they keep using."""
        value = self.new.get(key)
        return self.old.get(key) if value is None else value

    def get_many(self, keys: Sequence[Hashable]) -> list[int | None]:
        new, old = self.new.get, self.old.get
        return [new(key) or old(key) for key in keys]  # values are never 0: see Attribution's packing

    def put(self, key: Hashable, value: int) -> None:
        self.new[key] = value
        if len(self.new) >= self.half:
            self.old, self.new = self.new, {}

    def rotate_if_full(self) -> None:
        """After writing to `new` directly (hot loops do): keep the bound."""
        if len(self.new) >= self.half:
            self.old, self.new = newest(self.new, self.half), {}

    def clear(self) -> None:
        self.new, self.old = {}, {}


class FingerprintSet:
    """A bounded set of fingerprints, two generations like `Generations`."""

    def __init__(self, bound: int):
        self.half = max(bound // 2, 1)
        self.new: set[int] = set()
        self.old: set[int] = set()

    def __len__(self) -> int:
        return len(self.new) + len(self.old)

    def __contains__(self, item: int) -> bool:
        return item in self.new or item in self.old

    def update(self, items: Sequence[int]) -> None:
        self.new.update(items)
        self.rotate_if_full()

    def rotate_if_full(self) -> None:
        """After writing to `new` directly (hot loops do): keep the bound."""
        if len(self.new) >= self.half:
            self.old, self.new = newest(self.new, self.half), set()
