"""What a host (CPU) tier would be worth: its size in blocks, from the flag or the tier vLLM reports,
and the load it would add. Pure; the sidecar and the analyzer share it.

A host tier of H blocks beside a GPU cache that evicts into it keeps an evicted block while fewer
than H blocks were evicted after it (LRU); with the GPU cache full every stored block evicts one, so
a block recomputed within H stored blocks of its eviction would have been loaded from the host
instead (derive/attribution.py counts them: `host_hit_tokens`). docs/kv-events.md gives the bias.
"""

from __future__ import annotations

from collections.abc import Mapping

from .cache_config import config_number

GIB = 1 << 30


def kv_bytes_per_token(config: Mapping[str, str] | None) -> float | None:
    """KV bytes one token takes across every layer and KV-cache group: vLLM's kv_cache_memory_bytes
    over kv_cache_size_tokens (both group-aware), from cache_config_info; None when either is unset."""
    memory, tokens = (
        config_number(config, "kv_cache_memory_bytes"),
        config_number(config, "kv_cache_size_tokens"),
    )
    if memory is None or not tokens or memory <= 0 or tokens <= 0:
        return None
    return memory / tokens


def host_tier_blocks(config: Mapping[str, str] | None, host_bytes: int | None) -> int | None:
    """Blocks a host tier holds: `host_bytes` (--whatif.host-tier-bytes) over the bytes of one block,
    else the tier vLLM reports (num_cpu_blocks, or kv_offloading_size in GiB); None when unknown."""
    if host_bytes is None:
        reported = config_number(config, "num_cpu_blocks")
        if reported is not None and 0 < reported < 1 << 40:
            return int(reported)
        gib = config_number(config, "kv_offloading_size")
        host_bytes = int(gib * GIB) if gib is not None and 0 < gib < 1 << 20 else None
    per_token, block_size = kv_bytes_per_token(config), config_number(config, "block_size")
    if host_bytes is None or per_token is None or not block_size or block_size <= 0:
        return None
    return int(host_bytes // (per_token * block_size))


def host_hit_ratio(hit_tokens: float, query_tokens: float, host_hit_tokens: float) -> float | None:
    """The hit ratio with the host tier added: its hits count as hits. None without queries, or
    above 1 (more host hits than queries: a fault, never clipped into a healthy-looking ratio)."""
    if query_tokens <= 0:
        return None
    ratio = max((hit_tokens + host_hit_tokens) / query_tokens, 0.0)
    return ratio if ratio <= 1.0 else None
