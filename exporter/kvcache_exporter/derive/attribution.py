"""Why was each block computed? Live miss attribution from vLLM's KV-event stream. Pure, no I/O.

`BlockStored` lists blocks vLLM had to compute (hits produce no event). `Attribution.apply(batch)`
classifies every stored block, in stream order, by the first rule that holds:

1. `evicted`: its hash was stored before by this publisher and removed since (`BlockRemoved`);
2. `restart`: its hash was resident before the publisher restarted (seq went back) or before an
   `AllBlocksCleared`, and not stored since;
3. `other_replica`: the hash is resident on another replica, as told by the `other_replica` hook
   (a lone sidecar passes none, so it never sets this cause; the fleet view passes
   `FleetResidency`'s residency test);
4. `prefix_diverged`: its hash is new, but its token content was computed before in another chain
   (content fingerprints, see fingerprints.py: at least half of the block's anchors were seen);
5. `cold`: none of the above (also a hash still resident when stored again: two requests
   computing the same new prefix in one step, or the recomputed last block of a fully cached prompt).

Decode-filled blocks are counted apart (`decode_tokens`), not as prompt misses: a `BlockStored`
of exactly one block whose parent is the still-unextended last block of an earlier event is a
request's decode filling its next block (prefill stores all its full blocks in one event per step).

Bounded: `max_blocks` tracked hashes and `max_fingerprints` fingerprints (two-generation maps),
whatever the stream does. A publisher restart or `AllBlocksCleared` starts a new era in O(1);
blocks of an older era read as `restart`. Sequence gaps are counted (`missed_batches`): the miss
tokens of lost batches are never attributed, which the coverage ratio shows.

For the fleet (issue 11): one `Attribution` per replica, each given
`other_replica=lambda h: fleet.held_elsewhere(replica, h)` or similar; nothing else changes.

What-if capacity: a block evicted and recomputed after D further stored blocks would still have
been resident in a cache of f x the capacity when D <= (f-1) x capacity (every block stored
after the eviction pushed it one place further down the LRU order). `extra_hit_tokens[f]` adds
those blocks' tokens; the estimate is (hits + extra) / queries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..sources.kv_events_decode import MAX_SEQ_GAP, Batch, Dropped, Event, KvEventDrain
from .fingerprints import ANCHOR_SPACING, FingerprintSet, Generations, anchored_prints

CAUSES = ("evicted", "restart", "prefix_diverged", "other_replica", "cold")
CAPACITY_FACTORS = (2, 4)
# Token offsets of the divergence histogram: where shared content starts in a prompt.
OFFSET_BUCKETS = (4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

# A tracked block is one int: flags | depth << 4 | era << 24 | stamp << 40 (stamp: blocks stored
# when it was stored or removed). One int per hash keeps a tracked block near 100 bytes.
_REMOVED, _DIVERGED, _OPEN_TIP, _DEPTH_KNOWN = 1, 2, 4, 8
_DEPTH_MAX = (1 << 20) - 1
_ERA_MASK = (1 << 16) - 1


_KEEP_ON_REMOVE = ((1 << 40) - 1) & ~_OPEN_TIP  # flags, depth and era; the stamp is replaced


def _depth(info: int) -> int | None:
    return (info >> 4) & _DEPTH_MAX if info & _DEPTH_KNOWN else None


@dataclass
class Totals:
    """Cumulative counts since start (counters: they only grow)."""

    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0))
    decode_tokens: int = 0
    extra_hit_tokens: dict[int, int] = field(default_factory=lambda: dict.fromkeys(CAPACITY_FACTORS, 0))
    offset_counts: list[int] = field(default_factory=lambda: [0] * (len(OFFSET_BUCKETS) + 1))
    offset_sum: float = 0.0
    batches: int = 0
    missed_batches: int = 0
    restarts: int = 0

    @property
    def prompt_miss_tokens(self) -> int:
        return sum(self.tokens.values())


class Attribution:
    def __init__(
        self,
        max_blocks: int = 400_000,
        max_fingerprints: int = 800_000,
        capacity_blocks: int | None = None,
        other_replica: Callable[[int | bytes], bool] | None = None,
    ):
        self.capacity_blocks = capacity_blocks  # vLLM's num_gpu_blocks when known (cache_config_info)
        self.other_replica = other_replica
        self.totals = Totals()
        self.resident = 0
        self.resident_peak = 0
        self._blocks = Generations(max_blocks)
        self._content = FingerprintSet(max_fingerprints)
        self.limits = (max_blocks, max_fingerprints)
        self._stored = 0  # blocks stored so far: the clock of the what-if estimate
        self._era = 0
        self._next: int | None = None

    @property
    def tracked(self) -> tuple[int, int]:
        """(tracked hashes, tracked fingerprints): never above the bounds."""
        return len(self._blocks), len(self._content)

    def ingest(self, drain: KvEventDrain) -> None:
        """A poll's drained stream: batches applied, dropped ones only move the expected seq (the
        exporter chose to drop them: not lost, but not attributed either, which coverage shows)."""
        for item in drain.items:
            if isinstance(item, Dropped):
                if item.seq is not None:
                    self._advance(item.seq)
                    self._next = item.seq + item.count
            else:
                self.apply(item)

    def apply(self, batch: Batch) -> None:
        self._advance(batch.seq)
        self.totals.batches += 1
        for event in batch.events:
            if event.type == "BlockStored":
                self._store(event)
            elif event.type == "BlockRemoved":
                self._remove(event.block_hashes)
            elif event.type == "AllBlocksCleared":
                self._new_era()

    def _advance(self, seq: int) -> None:
        expected = self._next
        if expected is not None:
            if expected <= seq <= expected + MAX_SEQ_GAP:
                self.totals.missed_batches += seq - expected
            else:  # back to a lower seq (or an absurd jump): a new publisher with an empty cache
                self.totals.restarts += 1
                self.totals.missed_batches += seq if seq <= MAX_SEQ_GAP else 0
                self._new_era()
        self._next = seq + 1

    def _new_era(self) -> None:
        self._era += 1
        self.resident = 0

    def _store(self, event: Event) -> None:
        hashes, tokens, blocks = event.block_hashes, event.token_ids, self._blocks
        count = len(hashes)
        if not count:
            return
        size = event.block_size or len(tokens) // count
        parent = None if event.parent is None else blocks.get(event.parent)
        depth = 0 if event.parent is None else (None if parent is None else _depth(parent))
        if parent is not None:
            blocks.put(event.parent, parent & ~_OPEN_TIP)
            if count == 1 and parent & _OPEN_TIP and not parent & _REMOVED:
                self.totals.decode_tokens += size
                self._track(hashes, depth, parent & _DIVERGED, ["decode"])
                return
        known, offset = self._content_known(tokens, size, count)
        totals, other, causes = self.totals.tokens, self.other_replica, []
        for block_hash, info, content in zip(hashes, blocks.get_many(hashes), known, strict=True):
            if info is not None:
                cause = self._seen_before(info, size)
            elif other is not None and other(block_hash):
                cause = "other_replica"
            else:
                cause = "prefix_diverged" if content else "cold"
            causes.append(cause)
            totals[cause] += size
        diverged = parent is not None and parent & _DIVERGED
        if not diverged and depth is not None and "prefix_diverged" in causes:
            self._observe_offset(depth * size + offset)
        self._track(hashes, depth, diverged, causes)

    def _content_known(self, tokens: Sequence[int], size: int, count: int) -> tuple[list[bool], int]:
        """Per block: is its content known (half of its anchors seen before)? And the token position
        in the event where the known content starts: ANCHOR_SPACING / 4 tokens before the first known
        anchor, never at or before the unknown anchor preceding it.
        The event's own fingerprints are added afterwards, so a block never matches itself."""
        found = anchored_prints(tokens)
        new, old = self._content.new, self._content.old
        seen, total, start, unknown_before = [0] * count, [0] * count, -1, -1
        for position, print_ in found:
            block = position // size
            if block >= count:
                break
            total[block] += 1
            if print_ in new or print_ in old:
                seen[block] += 1
                if start < 0:
                    start = max(unknown_before + 1, position - ANCHOR_SPACING // 4)
            elif start < 0:
                unknown_before = position
        verdicts, previous = [False] * count, False
        for block in range(count):  # a block without anchors reads like the one before it
            previous = verdicts[block] = 2 * seen[block] >= total[block] if total[block] else previous
        self._content.update([print_ for _, print_ in found])
        return verdicts, max(start, 0)

    def _seen_before(self, info: int, size: int) -> str:
        """The cause of a block whose hash is tracked: rules 1 and 2, or a duplicate store."""
        if info & _REMOVED:
            self._estimate(info >> 40, size)
            return "evicted"
        if (info >> 24) & _ERA_MASK != self._era & _ERA_MASK:
            return "restart"
        self.resident -= 1  # still resident: re-stored by a concurrent request, counted once
        return "cold"

    def _estimate(self, removed_at: int, size: int) -> None:
        capacity = self.capacity_blocks or self.resident_peak
        stored_since = self._stored - removed_at
        for factor in CAPACITY_FACTORS:
            if capacity and stored_since <= (factor - 1) * capacity:
                self.totals.extra_hit_tokens[factor] += size

    def _track(self, hashes: Sequence, depth: int | None, diverged: int | bool, causes: list[str]) -> None:
        """Remember the event's blocks: resident, in this era, the last one an open tip."""
        era, stored = (self._era & _ERA_MASK) << 24, self._stored
        known_depth = _DEPTH_KNOWN if depth is not None else 0
        depth = depth or 0
        last = len(hashes) - 1
        items = []
        for i, (block_hash, cause) in enumerate(zip(hashes, causes, strict=True)):
            diverged = diverged or cause == "prefix_diverged"
            flags = (_DIVERGED if diverged else 0) | (_OPEN_TIP if i == last else 0) | known_depth
            stored += 1
            items.append((block_hash, flags | min(depth + i, _DEPTH_MAX) << 4 | era | stored << 40))
        self._blocks.put_many(items)
        self._stored = stored
        self.resident += len(hashes)
        if self.resident > self.resident_peak:
            self.resident_peak = self.resident

    def _remove(self, hashes: Sequence[int | bytes]) -> None:
        blocks, stamp, removed = self._blocks, self._stored << 40, 0
        new, old = blocks.new, blocks.old
        for block_hash in hashes:  # inlined Generations.get/put: one BlockRemoved per evicted block
            info = new.get(block_hash) or old.get(block_hash)
            if info is not None and not info & _REMOVED:
                new[block_hash] = (info & _KEEP_ON_REMOVE) | _REMOVED | stamp
                removed += 1
        blocks.rotate_if_full()
        self.resident = max(self.resident - removed, 0)

    def _observe_offset(self, offset: int) -> None:
        totals = self.totals
        index = next((i for i, bound in enumerate(OFFSET_BUCKETS) if offset <= bound), len(OFFSET_BUCKETS))
        totals.offset_counts[index] += 1
        totals.offset_sum += offset
