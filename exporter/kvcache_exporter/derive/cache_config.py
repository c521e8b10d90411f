"""Reading vllm:cache_config_info labels: numbers printed with str(), "None" when unset."""

from __future__ import annotations

import math
from collections.abc import Mapping


def config_number(config: Mapping[str, str] | None, key: str) -> float | None:
    """A numeric label; None when absent, unset ("None") or not a number."""
    try:
        value = float((config or {})[key])
    except (KeyError, ValueError):
        return None
    return value if math.isfinite(value) else None  # "nan", "inf" are no sizes


def capacity_tokens(config: Mapping[str, str] | None) -> float | None:
    """Tokens the KV cache holds: kv_cache_size_tokens (group-aware) where vLLM exposes it,
    else num_gpu_blocks x block_size."""
    tokens = config_number(config, "kv_cache_size_tokens")
    if tokens is not None:
        return tokens
    blocks, block_size = config_number(config, "num_gpu_blocks"), config_number(config, "block_size")
    return None if blocks is None or block_size is None else blocks * block_size


def block_bytes(config: Mapping[str, str] | None) -> float | None:
    """Bytes of one KV block: kv_cache_memory_bytes / num_gpu_blocks (None while either is unknown)."""
    memory, blocks = config_number(config, "kv_cache_memory_bytes"), config_number(config, "num_gpu_blocks")
    return memory / blocks if memory and blocks else None
