"""Which replica of a pool holds which KV block, from every replica's KV-event stream. Pure, no I/O.

One dict maps a block hash to a bitmask of the replicas holding it. A `BlockStored` block on
replica R whose hash is held by another replica is an `other_replica` miss: a prefix-affine router
would have sent the request where the block already was. Hashes held by two or more replicas are
duplicates: KV memory spent twice.

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

from ..sources.kv_events_decode import IN_ORDER, Batch, Event, Mark, SeqCursor, gap
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


@dataclass
class ReplicaView:
    """One replica's stream as seen so far; counts are of kept (sampled) blocks."""

    bit: int
    engine: str = "vllm"
    resident: int = 0
    stored: int = 0
    other_replica: int = 0
    removed: int = 0
    overflow: int = 0  # stored blocks not tracked because the replica's bound was full
    batches: int = 0
    missed: int = 0
    restarts: int = 0
    cleared: int = 0
    cursor: SeqCursor = field(default_factory=SeqCursor)  # the replica's sequence, read once


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
        self._owners: dict[int | bytes | tuple[str, int | bytes], int] = {}
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
        if name not in self.replicas:
            bit = self._free_bits.pop() if self._free_bits else self._next_bit
            if bit == self._next_bit:
                self._next_bit <<= 1
            self.replicas[name] = ReplicaView(bit, engine)
        return self.replicas[name]

    def remove_replica(self, name: str) -> None:
        view = self.replicas.pop(name, None)
        if view is not None:
            self._forget(view)
            self.sessions.forget(view.bit)
            self._free_bits.append(view.bit)

    def missing(self, name: str, seq: int) -> range:
        """Sequence numbers lost before `seq` on this replica, read as the sidecar reads them."""
        view = self.replicas.get(name)
        return gap(view.cursor.next if view else None, seq)

    def apply(self, name: str, batch: Batch) -> None:
        view = self.add_replica(name)
        self.apply_marked(name, batch.events, view.cursor.advance(batch.seq))

    def apply_marked(self, name: str, events: Sequence[Event], mark: Mark = IN_ORDER) -> None:
        """Events whose place in the replica's stream its intake read (the NATS intake reads one
        sequence per hash range): `mark` says what was lost before them."""
        view = self.add_replica(name)
        self._mark(view, mark)
        view.batches += 1
        keep = self.hash_range.keep
        if view.engine != VLLM:  # another engine's hashes never match vLLM's, nor each other's
            keep = partial(_namespaced, keep, view.engine)
            # a lower tier's copy (HiCache's CPU_PINNED backup) is not on the pool's GPUs
            events = [event for event in events if event.medium in GPU_MEDIA]
        for event in events:
            if event.type == "BlockStored":
                self._store(view, keep(event.block_hashes))
                if event.session_id is not None:
                    self.sessions.seen(event.session_id, view.bit)
            elif event.type == "BlockRemoved":
                self._remove(view, keep(event.block_hashes))
            elif event.type == "AllBlocksCleared":
                view.cleared += 1
                self._forget(view)

    def skip(self, name: str, seq: int | None, count: int) -> None:
        """`count` messages from `seq` on that the subscriber dropped on purpose (rate limit, bad
        bytes): the sequence moves on without counting them as missed, as the sidecar does."""
        view = self.replicas.get(name)
        if view is not None:
            self._mark(view, view.cursor.skip(seq, count))

    def restart(self, name: str) -> None:
        """The replica's publisher started again, said by its intake: its cache starts empty."""
        self._mark(self.add_replica(name), Mark(0, True))

    def clear(self, name: str) -> None:
        """The replica's cache starts empty (AllBlocksCleared), said by its intake."""
        view = self.add_replica(name)
        view.cleared += 1
        self._forget(view)

    def _mark(self, view: ReplicaView, mark: Mark) -> None:
        """Back to a lower seq (or an absurd jump) is a new publisher whose cache starts empty."""
        view.missed += mark.lost
        if mark.restart:
            view.restarts += 1
            self._forget(view)

    def _store(self, view: ReplicaView, hashes: Iterable[int | bytes]) -> None:
        owners, bit, full = self._owners, view.bit, view.resident >= self.max_blocks
        for block_hash in hashes:
            view.stored += 1
            held = owners.get(block_hash, 0)
            if held & ~bit:
                view.other_replica += 1
            if held & bit:
                continue  # already ours: a re-store after a view went stale
            if full:
                view.overflow += 1
                continue
            if held and not held & (held - 1):
                self.duplicates += 1  # a second holder
            owners[block_hash] = held | bit
            view.resident += 1
            full = view.resident >= self.max_blocks

    def _remove(self, view: ReplicaView, hashes: Iterable[int | bytes]) -> None:
        owners, bit = self._owners, view.bit
        for block_hash in hashes:
            held = owners.get(block_hash, 0)
            if not held & bit:
                continue
            view.removed += 1
            view.resident -= 1
            self._drop_bit(block_hash, held, bit)

    def _forget(self, view: ReplicaView) -> None:
        bit = view.bit
        for block_hash, held in [item for item in self._owners.items() if item[1] & bit]:
            self._drop_bit(block_hash, held, bit)
        view.resident = 0

    def _drop_bit(self, block_hash: int | bytes, held: int, bit: int) -> None:
        rest = held & ~bit
        if not rest:
            del self._owners[block_hash]
            return
        if not rest & (rest - 1):
            self.duplicates -= 1  # back to a single holder
        self._owners[block_hash] = rest
