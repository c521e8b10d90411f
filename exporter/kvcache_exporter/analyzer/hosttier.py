"""What a host (CPU) tier is worth, exactly: a two-tier LRU replay of the trace.

The GPU cache is the simulator's model of vLLM's block pool (LRU free queue, a request's tail freed
first); every cached block it evicts enters a host LRU of H blocks. A prompt hits its cached GPU prefix,
then goes on block by block in the host: those blocks are loaded, not computed (a host hit), and leave
the host for the GPU. Requests run one at a time per replica, each replica with its own tier. The
sidecar estimates the same from the GPU's KV events alone (derive/whatif.py); this is the exact answer.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from ..simulator.blocks import BlockPool, block_hashes_for
from .blocktrace import BlockRequest, prompt_keys
from .replay import route
from .trace import TraceRequest


@dataclass(frozen=True)
class HostTier:
    host_blocks: int
    """per replica"""
    prompt_tokens: int
    gpu_hit_tokens: int
    host_hit_tokens: int
    """prompt tokens loaded from the host tier instead of computed"""
    rejected: int
    """requests that never fit the pool, skipped as the other replays skip them"""
    bytes_per_token: float | None = None
    """KV bytes of one token (from a --metrics capture); None when unknown"""

    @property
    def hit_ratio(self) -> float:
        """GPU and host hits over prompt tokens: the hit ratio with the tier."""
        hits = self.gpu_hit_tokens + self.host_hit_tokens
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def gpu_hit_ratio(self) -> float:
        return self.gpu_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def load_bytes(self) -> float | None:
        """Bytes the host hits would load into the GPU."""
        return None if self.bytes_per_token is None else self.host_hit_tokens * self.bytes_per_token

    def to_dict(self) -> dict:
        return {
            "host_blocks": self.host_blocks,
            "hit_ratio": self.hit_ratio,
            "gpu_hit_ratio": self.gpu_hit_ratio,
            "host_hit_tokens": self.host_hit_tokens,
            "rejected": self.rejected,
            "load_bytes": self.load_bytes,
        }


def two_tier_replay(
    requests: Sequence[TraceRequest] | Sequence[BlockRequest],
    block_size: int,
    gpu_blocks: int,
    host_blocks: int,
    replicas: int = 1,
    routing: str = "round-robin",
    bytes_per_token: float | None = None,
) -> HostTier:
    """Each replica: a pool of `gpu_blocks` blocks evicting into a host LRU of `host_blocks` blocks."""
    if gpu_blocks < 2 or host_blocks < 0:
        raise ValueError("two_tier_replay: gpu_blocks >= 2 and host_blocks >= 0 are required")
    tiers = [_Tiers(gpu_blocks, block_size, host_blocks) for _ in range(replicas)]
    gpu = host = prompt = rejected = 0
    for request, replica in zip(requests, route(requests, replicas, routing), strict=True):
        length = _prompt_len(request)
        if -(-(length + request.max_tokens - 1) // block_size) >= gpu_blocks:
            rejected += 1  # never fits the pool (one block is the null block): vLLM rejects it
            continue
        on_gpu, from_host = tiers[replica].run(_keys(request, block_size), length, request.max_tokens)
        gpu, host, prompt = gpu + on_gpu * block_size, host + from_host * block_size, prompt + length
    return HostTier(host_blocks, prompt, gpu, host, rejected, bytes_per_token)


class _Tiers:
    def __init__(self, gpu_blocks: int, block_size: int, host_blocks: int):
        self.pool = BlockPool(gpu_blocks, block_size, record_events=False)
        self.host: OrderedDict[bytes, None] = OrderedDict()
        self.block_size, self.host_blocks, self.unique = block_size, host_blocks, itertools.count()

    def run(self, keys: list[bytes], prompt_len: int, max_tokens: int) -> tuple[int, int]:
        """One request to completion: (blocks hit on the GPU, blocks loaded from the host)."""
        bs, pool = self.block_size, self.pool
        computed = prompt_len + max_tokens - 1
        keys = keys + [b"out%d" % next(self.unique) for _ in range(computed // bs - len(keys))]
        hittable = (prompt_len - 1) // bs  # vLLM recomputes the last prompt token
        on_gpu = pool.longest_cached_prefix(keys[:hittable])
        n = len(on_gpu)
        while n < hittable and keys[n] in self.host:
            del self.host[keys[n]]
            n += 1
        pool.touch(on_gpu)
        need = -(-computed // bs) - len(on_gpu)
        evicted = [b.block_hash for b in itertools.islice(pool.free_queue.values(), need) if b.block_hash]
        blocks = on_gpu + pool.get_new_blocks(need)
        for key in evicted:
            self.host[key] = None
            self.host.move_to_end(key)
            if len(self.host) > self.host_blocks:
                self.host.popitem(last=False)
        pool.cache_full_blocks(blocks, keys, (), len(on_gpu), computed // bs)
        pool.free_blocks(reversed(blocks))
        return len(on_gpu), n - len(on_gpu)


def _prompt_len(r: TraceRequest | BlockRequest) -> int:
    return r.prompt_tokens if isinstance(r, BlockRequest) else len(r.prompt_token_ids)


def _keys(r: TraceRequest | BlockRequest, block_size: int) -> list[bytes]:
    if isinstance(r, BlockRequest):
        return prompt_keys(r)
    return block_hashes_for(list(r.prompt_token_ids), block_size, [])


def render_text(tier: dict | None) -> list[str]:
    """The text report's lines for the tier (none without one)."""
    if tier is None:
        return []
    loaded = "" if tier["load_bytes"] is None else f", {_size(tier['load_bytes'])} loaded"
    label = f"with a host tier of {tier['host_blocks']} blocks"
    return [
        f"  {label:<31} {tier['hit_ratio']:6.3f}  (exact two-tier replay: {tier['host_hit_tokens']:,} tokens "
        f"from the host{loaded})"
    ]


def evidence(tier: dict | None) -> str:
    """The host tier's worth as the capacity diagnosis cites it ("" without a tier)."""
    if tier is None:
        return ""
    loaded = "" if tier["load_bytes"] is None else f", loading {_size(tier['load_bytes'])}"
    return (
        f" A host tier of {tier['host_blocks']} blocks per replica would reach {tier['hit_ratio']:.3f} "
        f"(exact two-tier replay{loaded})."
    )


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} GiB"
