"""Which replica of a pool holds which KV block, from every replica's KV-event stream. Pure, no I/O.

One dict maps a block hash to the ranks holding it (`fleet_holders`: a shape whose size per
(replica, block) does not grow with the pool). A `BlockStored` block on
replica R whose hash is held by another replica is an `other_replica` miss: a prefix-affine router
would have sent the request where the block already was. Hashes held by two or more replicas are
duplicates: KV memory spent twice.

A data-parallel replica's ranks are engines with caches of their own, each with its own stream
(and sequence), so each rank is a holder of its own with its own residency; the replica is the
union of its ranks. Across replicas only the replica counts: a block one rank stores while a sibling rank
holds it is not an `other_replica` miss (a prefix-affine router picks replicas, not ranks) and a
block two ranks of one replica hold is no fleet duplicate, while the replica's resident blocks are
its ranks' sum (each rank's copy is KV memory of its own).

Bounded and linear: each replica tracks at most `max_blocks_per_replica` hashes, and only hashes
inside one `HashRange` are kept at all. vLLM's hashes are the low 64 bits of a sha256 digest
(bytes hashes: their last 8 bytes, the same number), so a range of that 64-bit space is a uniform
sample, the same on every replica: cross-replica matches stay exact inside it. Counts of sampled
blocks are scaled by 1/sampling; hash-range shards are not scaled, so summing the shards gives the
unsharded numbers exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial

from ..sources.kv_events_decode import IN_ORDER, Batch, Event, Mark
from . import fleet_holders as holders
from .fleet_holders import Holders, Rank
from .fleet_sessions import SessionSpread

SPACE = 1 << 64
MASK = SPACE - 1
VLLM = "vllm"
GPU_MEDIA = (None, "GPU")


def _namespaced(keep, engine: str, hashes: Sequence[int | bytes]) -> list[tuple[str, int | bytes]]:
    """A non-vLLM replica's kept hashes keyed by its engine: two engines' opaque hashes (SGLang's
    SHA-256 over u32 tokens, vLLM's over its own encoding) are never one block, so never shared."""
    return [(engine, block_hash) for block_hash in keep(hashes)]


def hash_position(block_hash: int | bytes) -> int:
    """Where a hash sits in the 64-bit space: vLLM's int hash is the digest's low 64 bits."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[-8:], "big")
    return block_hash & MASK


@dataclass(frozen=True)
class HashRange:
    """The slice of the hash space one aggregator keeps: `sampling` of it, cut into `shards`."""

    sampling: float = 1.0
    shard: int = 0
    shards: int = 1
    bounds: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 < self.sampling <= 1:
            raise ValueError(f"sampling must be in (0, 1], not {self.sampling}")
        if not 0 <= self.shard < self.shards:
            raise ValueError(f"shard must be in [0, {self.shards}), not {self.shard}")
        kept = int(self.sampling * SPACE)
        bounds = (kept * self.shard // self.shards, kept * (self.shard + 1) // self.shards)
        object.__setattr__(self, "bounds", bounds)  # [lo, hi) of the 64-bit space, computed once

    def keep(self, hashes: Sequence[int | bytes]) -> Sequence[int | bytes]:
        """The hashes inside the range. Int hashes are taken as they are (vLLM's are in [0, 2^64));
        the common cases run in C: everything, or a range starting at 0 (sampling, shard 0)."""
        lo, hi = self.bounds
        if (lo, hi) == (0, SPACE):
            return hashes
        try:
            if lo == 0:
                return list(filter(partial(operator.gt, hi), hashes))  # raises on bytes
            return [h for h in hashes if lo <= h < hi]
        except TypeError:  # bytes hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), or a mix
            return [h for h in hashes if lo <= hash_position(h) < hi]


def _every(hashes: Sequence[int | bytes]) -> Sequence[int | bytes]:
    return hashes


@dataclass
class ReplicaView:
    """One replica's streams as seen so far (its ranks' counts summed); counts are of kept (sampled)
    blocks. `bit` is the replica's own in the session masks."""

    name: str
    bit: int
    engine: str = "vllm"
    ranks: dict[int, Rank] = field(default_factory=dict)
    resident: int = 0
    stored: int = 0
    other_replica: int = 0
    removed: int = 0
    overflow: int = 0  # stored blocks not tracked because the replica's bound was full
    batches: int = 0
    missed: int = 0
    restarts: int = 0
    cleared: int = 0


class FleetResidency:
    def __init__(
        self,
        hash_range: HashRange = HashRange(),
        max_blocks_per_replica: int = 1_000_000,
        sessions: SessionSpread | None = None,
    ):
        self.hash_range = hash_range
        self.max_blocks = max_blocks_per_replica
        self.sessions = sessions or SessionSpread()  # every event's session, whatever the hash range
        self.replicas: dict[str, ReplicaView] = {}
        self.duplicates = 0  # hashes held by >= 2 replicas
        self._owners: dict[int | bytes | tuple[str, int | bytes], Holders] = {}
        self._free_bits: list[int] = []
        self._next_bit = 1

    @property
    def scale(self) -> float:
        """What one kept block stands for."""
        return 1.0 / self.hash_range.sampling

    @property
    def distinct(self) -> int:
        return len(self._owners)

    def add_replica(self, name: str, engine: str = "vllm") -> ReplicaView:
        view = self.replicas.get(name)
        if view is None:
            bit = self._free_bits.pop() if self._free_bits else self._next_bit
            if bit == self._next_bit:
                self._next_bit <<= 1
            view = self.replicas[name] = ReplicaView(name, bit, engine)
            self._rank(view, 0)
        return view

    @staticmethod
    def _rank(view: ReplicaView, rank: int) -> Rank:
        """The replica's rank `rank`, given a bit among the replica's ranks when first seen."""
        state = view.ranks.get(rank)
        if state is None:
            state = view.ranks[rank] = Rank(view.name, 1 << len(view.ranks))
        return state

    def remove_replica(self, name: str) -> None:
        view = self.replicas.pop(name, None)
        if view is not None:
            for state in view.ranks.values():
                self._forget(view, state)
            self._free_bits.append(view.bit)
            self.sessions.forget(view.bit)

    def missing(self, name: str, seq: int, rank: int = 0) -> range:
        """Sequence numbers lost before `seq` on this replica's rank, read as the sidecar reads them."""
        view = self.replicas.get(name)
        state = view.ranks.get(rank) if view else None
        return state.cursor.gap(seq) if state else range(0)

    def apply(self, name: str, batch: Batch, rank: int = 0) -> None:
        state = self._rank(self.add_replica(name), rank)
        self.apply_marked(name, batch.events, state.cursor.advance(batch.seq), rank)

    def apply_marked(
        self, name: str, events: Sequence[Event], mark: Mark = IN_ORDER, rank: int = 0, within: bool = False
    ) -> None:
        """Events whose place in the rank's stream its intake read (the NATS intake reads one
        sequence per hash range): `mark` says what was lost before them; `within`: every hash is
        known to be inside the range (a NATS subject's range wholly the shard's), none filtered."""
        view = self.add_replica(name)
        state = self._rank(view, rank)
        self._mark(view, state, mark)
        view.batches += 1
        keep = _every if within else self.hash_range.keep
        if view.engine != VLLM:  # another engine's hashes never match vLLM's, nor each other's
            keep = partial(_namespaced, keep, view.engine)
            # a lower tier's copy (HiCache's CPU_PINNED backup) is not on the pool's GPUs
            events = [event for event in events if event.medium in GPU_MEDIA]
        for event in events:
            if event.type == "BlockStored":
                self._store(view, state, keep(event.block_hashes))
                if event.session_id is not None:
                    self.sessions.seen(event.session_id, view.bit)
            elif event.type == "BlockRemoved":
                self._remove(view, state, keep(event.block_hashes))
            elif event.type == "AllBlocksCleared":
                view.cleared += 1
                self._forget(view, state)

    def skip(self, name: str, seq: int | None, count: int, rank: int = 0) -> None:
        """`count` messages from `seq` on that the subscriber dropped on purpose (rate limit, bad
        bytes): the sequence moves on without counting them as missed, as the sidecar does."""
        view = self.replicas.get(name)
        if view is not None:
            state = self._rank(view, rank)
            self._mark(view, state, state.cursor.skip(seq, count))

    def restart(self, name: str, rank: int = 0) -> None:
        """The rank's publisher started again, said by its intake: its cache starts empty."""
        view = self.add_replica(name)
        self._mark(view, self._rank(view, rank), Mark(0, True))

    def clear(self, name: str, rank: int = 0) -> None:
        """The rank's cache starts empty (AllBlocksCleared), said by its intake."""
        view = self.add_replica(name)
        view.cleared += 1
        self._forget(view, self._rank(view, rank))

    def _mark(self, view: ReplicaView, state: Rank, mark: Mark) -> None:
        """Back to a lower seq (or an absurd jump) is a new publisher whose cache starts empty."""
        view.missed += mark.lost
        if mark.restart:
            view.restarts += 1
            self._forget(view, state)

    def _store(self, view: ReplicaView, state: Rank, hashes: Sequence[int | bytes]) -> None:
        owners, name, sole_replica = self._owners, view.name, holders.sole_replica
        room = self.max_blocks - view.resident
        added = other = duplicates = 0  # counted here, added once: the loop runs per block
        for block_hash in hashes:
            held = owners.get(block_hash)
            if held is None:
                if added >= room:
                    view.overflow += 1
                    continue
                owners[block_hash] = state
                added += 1
                continue
            if held is state:
                continue  # already this rank's alone: a re-store after a view went stale
            sole = sole_replica(held)
            if sole != name:
                other += 1
            if holders.holds(held, state):
                continue
            if added >= room:
                view.overflow += 1
                continue
            if sole is not None and sole != name:
                duplicates += 1  # a second replica holds it
            owners[block_hash] = holders.add(held, state)
            added += 1
        view.stored += len(hashes)
        view.other_replica += other
        view.resident += added
        state.resident += added
        self.duplicates += duplicates

    def _remove(self, view: ReplicaView, state: Rank, hashes: Iterable[int | bytes]) -> None:
        owners = self._owners
        for block_hash in hashes:
            held = owners.get(block_hash)
            if held is None or not (held is state or holders.holds(held, state)):
                continue
            view.removed += 1
            view.resident -= 1
            state.resident -= 1
            self._drop(block_hash, held, state)

    def _forget(self, view: ReplicaView, state: Rank) -> None:
        holds = holders.holds
        for block_hash, held in [item for item in self._owners.items() if holds(item[1], state)]:
            self._drop(block_hash, held, state)
        view.resident -= state.resident
        state.resident = 0

    def _drop(self, block_hash: int | bytes | tuple[str, int | bytes], held: Holders, state: Rank) -> None:
        rest = holders.remove(held, state)
        if rest is None:
            del self._owners[block_hash]
            return
        self._owners[block_hash] = rest
        sole = holders.sole_replica(rest)
        if sole is not None and sole != state.replica:
            self.duplicates -= 1  # the replica no longer holds it: back to a single replica
