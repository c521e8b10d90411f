"""KV-cache layouts: the groups vLLM 0.32 builds for a model, and what each group stores and announces.

`llama` is one full-attention group (the simulator's default; the plain `BlockPool` serves it). The hybrid
layouts share one pool of *units* (vLLM's scheduler block: the LCM of the group block sizes, which is also
the hit unit) and announce every stored unit once per group, after vLLM's
`v1/core/single_type_kv_cache_manager.py` and `kv_cache_coordinator.py`:

- hashes are the chain over `hash_block_size` tokens; a group block's hash is that chain at the block's end,
  so one value appears in several groups;
- a full group announces every block of the stored range, parent = the chain at the range's start;
- a window group announces only the `cdiv(window - 1, block)` blocks ending at the request's replay
  boundary (`num_prompt_tokens - 1` aligned down to the unit: vLLM's default retention interval 0), with all
  the range's token ids: decode-filled units announce no hash at all;
- a unit is a hit only while the full groups hold the whole prefix and every window group holds the tail
  ending at the hit's end;
- a full group with blocks coarser than the hash also announces the prompt's tail inside a block (one
  `hash_block_size` event: DeepSeek-V4's group 3 `block_size` 4 events).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .blocks import NO_ORIGIN, Block, BlockPool, BlockRemoved, BlockStored, Origin, external_hash


@dataclass(frozen=True)
class KVGroup:
    kind: str
    block_size: int
    sliding_window: int | None = None

    def tail_blocks(self) -> int:
        """Blocks a window group needs before a hit's end (vLLM's `_contiguous_blocks_for_hit`)."""
        return 0 if self.sliding_window is None else -(-(self.sliding_window - 1) // self.block_size)


@dataclass(frozen=True)
class Layout:
    name: str
    groups: tuple[KVGroup, ...]
    hash_block_size: int
    cache_config: tuple[tuple[str, str], ...] = ()
    """cache_config_info labels this layout changes."""

    @property
    def unit(self) -> int:
        return math.lcm(*(g.block_size for g in self.groups))

    @property
    def hybrid(self) -> bool:
        return len(self.groups) > 1


_SWA_MLA, _GEMMA_SWA = KVGroup("sliding_window_mla", 64, 128), KVGroup("sliding_window", 32, 64)
LAYOUTS = {
    "llama": None,
    # Measured with ../shared/tools/deepseek-v4-cpu: `kv cache group sizes (64, 64, 64, 256, 4, 8)`.
    "deepseek-v4": Layout(
        "deepseek-v4",
        (
            _SWA_MLA,
            _SWA_MLA,
            _SWA_MLA,
            KVGroup("mla_attention", 256),
            KVGroup("sliding_window_mla", 4, 8),
            KVGroup("sliding_window_mla", 8, 128),
        ),
        hash_block_size=4,
        cache_config=(
            ("block_size", "4"),
            ("effective_attention_block_size", "256"),
            ("sliding_window", "128"),
        ),
    ),
    # Gemma-3's pattern: 5 sliding-window layers (window 64) per full-attention layer, block 32.
    "gemma-3": Layout("gemma-3", (*[_GEMMA_SWA] * 5, KVGroup("full_attention", 32)), hash_block_size=32),
    # Gemma-2's: alternating (the deployments/hybrid-gemma2-swa capture).
    "gemma-2": Layout("gemma-2", (_GEMMA_SWA, KVGroup("full_attention", 32)), hash_block_size=32),
}


def layout_named(name: str) -> Layout | None:
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r} (one of {', '.join(LAYOUTS)})")
    return LAYOUTS[name]


def unit_hashes(fine: Sequence[bytes], per_unit: int) -> list[bytes]:
    """The chain at every unit's end, from the chain at every `hash_block_size` tokens."""
    return list(fine[per_unit - 1 :: per_unit])


def tail_range(group: KVGroup, boundary_tokens: int) -> range:
    """The group blocks a hit ending at `boundary_tokens` needs."""
    end = boundary_tokens // group.block_size
    return range(max(end - group.tail_blocks(), 0), end)


class HybridBlockPool(BlockPool):
    """A pool of units; each cached unit holds its part of every group (the hashes announced for it),
    removed together when the unit is evicted (vLLM frees window blocks separately: see docs/simulator.md)."""

    def __init__(self, num_gpu_blocks: int, layout: Layout, record_events: bool = True) -> None:
        super().__init__(num_gpu_blocks, layout.unit, record_events=record_events)
        self.layout = layout
        self.parts: dict[int, list[tuple[int, int]]] = {}
        """block id -> the (group, external hash) parts it holds beside the full groups' own hash."""
        self.tails: dict[bytes, int] = {}
        """Unit hash at whose end every window group holds its tail -> the block id holding them."""

    def hit_units(self, units: Sequence[bytes], max_units: int) -> list[Block]:
        """vLLM's hybrid rule: the longest prefix the full groups hold, cut back to the last unit at whose
        end every window group holds its tail (or to nothing)."""
        prefix = self.longest_cached_prefix(units[:max_units])
        if all(g.sliding_window is None for g in self.layout.groups):
            return prefix
        for length in range(len(prefix), 0, -1):
            if units[length - 1] in self.tails:
                return prefix[:length]
        return []

    def _evict(self, block: Block) -> None:
        self._uncache(block)
        parts = self.parts.pop(block.block_id, ())
        if self.tails.get(block.block_hash) == block.block_id:
            del self.tails[block.block_hash]
        if self.record_events:
            unit_hash = external_hash(block.block_hash)
            for index, group in enumerate(self.layout.groups):
                if group.sliding_window is None:
                    self.events.append(BlockRemoved([unit_hash], index))
            self.events.extend(BlockRemoved([h], g) for g, h in parts)
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        done = super().reset_prefix_cache()
        if done:
            self.parts.clear()
            self.tails.clear()
        return done

    def cache_units(
        self,
        blocks: Sequence[Block],
        units: Sequence[bytes],
        fine: Sequence[bytes],
        token_ids: Sequence[int],
        num_cached: int,
        num_full: int,
        num_prompt_tokens: int,
        origin: Origin = NO_ORIGIN,
    ) -> None:
        """Cache units [num_cached, num_full) and announce them: one BlockStored per group, in group order."""
        if num_cached >= num_full:
            return
        self._cache(blocks, units, num_cached, num_full)
        layout, unit, h = self.layout, self.block_size, self.layout.hash_block_size
        boundary = (num_prompt_tokens - 1) // unit * unit
        tail_unit = boundary // unit - 1
        holds_tail = num_cached <= tail_unit < num_full
        if holds_tail:
            self.tails[units[tail_unit]] = blocks[tail_unit].block_id
        start, end = num_cached * unit, num_full * unit
        parent = external_hash(fine[start // h - 1]) if num_cached else None
        tokens = list(token_ids[start:end])
        for index, group in enumerate(layout.groups):
            b = group.block_size
            if group.sliding_window is None:
                wanted = range(start // b, end // b)
            else:
                tail = tail_range(group, boundary) if holds_tail else range(0)
                wanted = range(max(tail.start, start // b), min(tail.stop, end // b))
            hashes = [external_hash(fine[(j + 1) * b // h - 1]) for j in wanted]
            if group.sliding_window is not None and hashes:
                self.parts.setdefault(blocks[tail_unit].block_id, []).extend((index, x) for x in hashes)
            if self.record_events:
                self.events.append(
                    BlockStored(hashes, parent, tokens, b, index, group.kind, group.sliding_window, origin)
                )
            if group.sliding_window is None and b != h:
                self._partial_tail(blocks, fine, token_ids, start, end, num_prompt_tokens, index, origin)

    def _partial_tail(
        self,
        blocks: Sequence[Block],
        fine: Sequence[bytes],
        token_ids: Sequence[int],
        start: int,
        end: int,
        num_prompt_tokens: int,
        index: int,
        origin: Origin,
    ) -> None:
        """A full group whose block is coarser than the hash also caches the prompt's tail inside a block
        (vLLM's `_cache_partial_tail_block`): one hash_block_size-sized BlockStored, parent the chain one
        hash block earlier, removed with the block."""
        group, h = self.layout.groups[index], self.layout.hash_block_size
        boundary = (num_prompt_tokens - 1) // h * h
        if not start < boundary < end or boundary % group.block_size == 0:
            return
        partial = external_hash(fine[boundary // h - 1])
        self.parts.setdefault(blocks[boundary // self.block_size].block_id, []).append((index, partial))
        if self.record_events:
            parent = external_hash(fine[boundary // h - 2]) if boundary > h else None
            tokens = list(token_ids[boundary - h : boundary])
            self.events.append(BlockStored([partial], parent, tokens, h, index, group.kind, None, origin))

    def reuse_report(
        self, block_hashes: Sequence[bytes], token_ids: Sequence[int], num_hit: int, origin: Origin
    ) -> None:
        """Every group re-announces the hit prefix (all its blocks, window groups too), parent null."""
        if not self.record_events or not num_hit:
            return
        fine, h, end = block_hashes, self.layout.hash_block_size, num_hit * self.block_size
        for index, group in enumerate(self.layout.groups):
            b = group.block_size
            hashes = [external_hash(fine[(j + 1) * b // h - 1]) for j in range(end // b)]
            tokens = list(token_ids[:end])
            self.events.append(
                BlockStored(hashes, None, tokens, b, index, group.kind, group.sliding_window, origin)
            )

    def take_events(self):
        """vLLM's hybrid manager sends a step's removals before its stores."""
        events, self.events = self.events, []
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        return removed + [e for e in events if not isinstance(e, BlockRemoved)] if removed else events
