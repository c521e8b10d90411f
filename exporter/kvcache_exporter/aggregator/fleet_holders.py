"""Which ranks hold one block hash, in a shape whose size does not grow with the pool. Pure.

A shard sees every replica of the pool, so a holder set indexed by replica (a bitmask of replica
bits) costs each hash up to pool-size bits. Most hashes have one holder, some a few, a prefix
every replica shares many; so a hash's holders are, by count:

* one rank: the `Rank` itself, shared by all the hashes it holds (no allocation per hash);
* up to `SMALL` ranks: a tuple of them;
* more: a dict of replica name -> the bits (within the replica, bounded by its data-parallel
  size) of its ranks that hold the hash, so membership and "held by one replica" stay O(1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sources.kv_events_decode import SeqCursor

SMALL = 8


@dataclass(eq=False)  # a rank is itself, held by identity
class Rank:
    """One data-parallel rank's stream: its replica, its bit among the replica's ranks, its
    sequence and residency."""

    replica: str
    bit: int
    resident: int = 0
    cursor: SeqCursor = field(default_factory=SeqCursor)  # the rank's sequence, read once


Holders = Rank | tuple[Rank, ...] | dict[str, int]


def holds(held: Holders, rank: Rank) -> bool:
    if type(held) is Rank:
        return held is rank
    if type(held) is tuple:
        return rank in held
    return bool(held.get(rank.replica, 0) & rank.bit)


def sole_replica(held: Holders) -> str | None:
    """The one replica whose ranks hold the hash, None when two or more do."""
    if type(held) is Rank:
        return held.replica
    if type(held) is tuple:
        first = held[0].replica
        return first if all(r.replica == first for r in held) else None
    return next(iter(held)) if len(held) == 1 else None


def add(held: Holders | None, rank: Rank) -> Holders:
    """`held` (None for no holder) with `rank`, which it does not hold yet."""
    if held is None:
        return rank
    if type(held) is Rank:
        return (held, rank)
    if type(held) is tuple:
        if len(held) < SMALL:
            return (*held, rank)
        many: dict[str, int] = {}
        for each in held:
            many[each.replica] = many.get(each.replica, 0) | each.bit
        held = many
    held[rank.replica] = held.get(rank.replica, 0) | rank.bit
    return held


def remove(held: Holders, rank: Rank) -> Holders | None:
    """`held` without `rank`, which it holds; None when no holder is left."""
    if type(held) is Rank:
        return None
    if type(held) is tuple:
        rest = tuple(r for r in held if r is not rank)
        return rest[0] if len(rest) == 1 else rest
    bits = held[rank.replica] & ~rank.bit
    if bits:
        held[rank.replica] = bits
    else:
        del held[rank.replica]
    return held or None


def replicas(held: Holders) -> set[str]:
    """Every replica whose ranks hold the hash."""
    if type(held) is Rank:
        return {held.replica}
    if type(held) is tuple:
        return {r.replica for r in held}
    return set(held)
