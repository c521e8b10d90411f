"""vLLM's paged KV block pool with prefix caching (after `vllm/v1/core/block_pool.py`).

Blocks are plain objects; the free queue is an ordered dict used as a doubly linked list:
the front is evicted first. Events are collected in `events` and drained once per step.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from .residency import Residency


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """Chained block hash: covers the parent's hash, this block's token ids (stable encoding) and its
    extra keys (a LoRA adapter's name: the same tokens hash differently per adapter, as in vLLM)."""
    parent = parent_hash if parent_hash is not None else b"\x00" * 32
    payload = parent + struct.pack(f">{len(token_ids)}q", *token_ids) + extra
    return hashlib.sha256(payload).digest()


def external_hash(block_hash: bytes) -> int:
    """What KV events carry: the low 64 bits of the big-endian digest, as vLLM does."""
    return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF


def block_hashes_for(
    token_ids: Sequence[int], block_size: int, known: list[bytes], extra: bytes = b""
) -> list[bytes]:
    """Extend `known` (hashes of the leading full blocks) to every full block of `token_ids`."""
    for start in range(len(known) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = known[-1] if known else None
        known.append(hash_block_tokens(parent, token_ids[start : start + block_size], extra))
    return known


@dataclass(frozen=True)
class Origin:
    """Who stored a block, as vLLM's BlockStored says it: the LoRA adapter and the request's session."""

    lora_id: int | None = None
    lora_name: str | None = None
    session_id: str | None = None

    def extra_key(self) -> list[str] | None:
        """One block's `extra_keys` entry: the adapter's name (vLLM publishes them untagged)."""
        return None if self.lora_name is None else [self.lora_name]


NO_ORIGIN = Origin()


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    group_idx: int = 0
    kv_cache_spec_kind: str | None = "full_attention"
    sliding_window: int | None = None
    origin: Origin = NO_ORIGIN
    medium: str = "GPU"


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    group_idx: int = 0
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(eq=False, slots=True)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass
class BlockPool:
    num_gpu_blocks: int
    block_size: int
    blocks: list[Block] = field(init=False)
    free_queue: OrderedDict[int, Block] = field(init=False)
    cached: dict[bytes, dict[int, Block]] = field(init=False)
    events: list[KVEvent] = field(init=False)
    residency: Residency | None = None
    record_events: bool = True
    now: float = 0.0
    """The engine's clock at the current step: residency sampling stamps allocations and accesses with it."""

    def __post_init__(self) -> None:
        if self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be at least 2 (one is the null block)")
        self.blocks = [Block(i) for i in range(self.num_gpu_blocks)]
        # Block 0 is vLLM's null block: never free, never counted as usable.
        self.free_queue = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached = {}
        self.events = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / (self.num_gpu_blocks - 1)

    def longest_cached_prefix(self, block_hashes: Sequence[bytes]) -> list[Block]:
        hit: list[Block] = []
        for block_hash in block_hashes:
            same_hash = self.cached.get(block_hash)
            if not same_hash:
                break
            hit.append(next(iter(same_hash.values())))
        return hit

    def touch(self, blocks: Iterable[Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1
            if self.residency is not None:
                self.residency.accessed(block.block_id, self.now)

    def get_new_blocks(self, count: int) -> list[Block]:
        if count > self.num_free_blocks:
            raise ValueError(f"cannot get {count} free blocks from the pool")
        if self.residency is None:  # the common case, without the sampling's two calls a block
            pop = self.free_queue.popitem
            taken = [pop(last=False)[1] for _ in range(count)]
            for block in taken:
                if block.block_hash is not None:
                    self._evict(block)
                block.ref_cnt = 1
            return taken
        taken = []
        for _ in range(count):
            _, block = self.free_queue.popitem(last=False)
            if self.residency is not None:  # vLLM ends a sampled block's residency on reuse, hashed or not
                self.residency.evicted(block.block_id, self.now)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            if self.residency is not None:
                self.residency.allocated(block.block_id, self.now)
            taken.append(block)
        return taken

    def _evict(self, block: Block) -> None:
        self._uncache(block)
        if self.record_events:
            self.events.append(BlockRemoved([external_hash(block.block_hash)]))
        block.block_hash = None

    def _uncache(self, block: Block) -> None:
        same_hash = self.cached.get(block.block_hash, {})
        same_hash.pop(block.block_id, None)
        if not same_hash:
            self.cached.pop(block.block_hash, None)

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        num_cached: int,
        num_full: int,
        origin: Origin = NO_ORIGIN,
    ) -> None:
        """Give blocks[num_cached:num_full] their hashes and announce them (one BlockStored)."""
        if num_cached >= num_full:
            return
        new_hashes = self._cache(blocks, block_hashes, num_cached, num_full)
        if not self.record_events:
            return
        new_hashes = [external_hash(h) for h in new_hashes]
        parent = external_hash(block_hashes[num_cached - 1]) if num_cached else None
        tokens = list(token_ids[num_cached * self.block_size : num_full * self.block_size])
        self.events.append(BlockStored(new_hashes, parent, tokens, self.block_size, origin=origin))

    def _cache(
        self, blocks: Sequence[Block], block_hashes: Sequence[bytes], num_cached: int, num_full: int
    ) -> list[bytes]:
        """Put blocks[num_cached:num_full] in the hash table; -> the hashes of those not cached before."""
        new_hashes, cached = [], self.cached
        for index in range(num_cached, num_full):
            block = blocks[index]
            if block.block_hash is not None:
                continue
            block.block_hash = block_hash = block_hashes[index]
            # vLLM keeps duplicates; a lookup returns the first one cached.
            same_hash = cached.get(block_hash)
            if same_hash is None:
                cached[block_hash] = {block.block_id: block}
            else:
                same_hash[block.block_id] = block
            new_hashes.append(block_hash)
        return new_hashes

    def reuse_report(
        self, block_hashes: Sequence[bytes], token_ids: Sequence[int], num_hit: int, origin: Origin
    ) -> None:
        """`kv_cache_report_mode=full`: re-announce a request's hit prefix, parent null (vLLM's
        `emit_cached_block_events`)."""
        if self.record_events and num_hit:
            hashes = [external_hash(h) for h in block_hashes[:num_hit]]
            tokens = list(token_ids[: num_hit * self.block_size])
            self.events.append(BlockStored(hashes, None, tokens, self.block_size, origin=origin))

    def free_blocks(self, ordered_blocks: Iterable[Block]) -> None:
        """Release blocks, first one evicted first: unhashed ones go to the front, cached ones to the back."""
        freeable = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                freeable.append(block)
        fresh = [b for b in freeable if b.block_hash is None]
        for block in reversed(fresh):
            self.free_queue[block.block_id] = block
            self.free_queue.move_to_end(block.block_id, last=False)
        for block in freeable:
            if block.block_hash is not None:
                self.free_queue[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self.cached.clear()
        if self.residency is not None:
            self.residency.reset()
        for block in self.blocks:
            block.block_hash = None
        self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events
