"""Config checks on what prefix caching really does, beside what vLLM was told (derive/audit.py runs them):

- prefix_caching_effective: vLLM looks prompts up in its prefix cache: over the longest window, prompt
  tokens grew and so did prefix-cache queries. vLLM turns caching off behind the flags for MLA models on
  CPUs without AMX and for some hybrid models (queries stay 0 while prompts flow, no KV event).
- hybrid_kv_cache_manager_enabled: a model with sliding-window layers (cache_config_info's sliding_window)
  gets one KV-cache group per layer kind; fails when the KV-event stream shows a single full-attention
  group for it (`--disable-hybrid-kv-cache-manager`: every window layer keeps its whole context).
- hit_unit_near_block_size: prefix hits come in units of effective_attention_block_size, at most
  HIT_UNIT_FACTOR x the block_size users set and see (DeepSeek-V4: block_size 4, hits in 256-token units).
- window_retention: on a hybrid model (a windowed group in the KV-event stream) whose window parts
  are dropped before reuse (window_expired tokens over the longest window), vLLM's
  --prefix-cache-retention-interval is set (above 0, its default).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from .cache_config import config_number

CacheConfig = Mapping[str, str]

HIT_UNIT_FACTOR = 4
FULL_ATTENTION = "full_attention"


def prefix_caching_effective(prompt_tokens: float | None, query_tokens: float | None) -> bool | None:
    """Prompt and prefix-cache query tokens counted over one window; None while no prompt came."""
    if not prompt_tokens or prompt_tokens <= 0:
        return None
    return bool(query_tokens and query_tokens > 0)


def hybrid_kv_cache_manager_enabled(
    configs: Sequence[CacheConfig], stream_kinds: Collection[str] | None
) -> bool | None:
    """stream_kinds: the kv_cache_spec_kind values the model's BlockStored events carried (None: no
    stream, or nothing stored yet). Only a model with a sliding window can be judged."""
    windowed = any(config_number(config, "sliding_window") for config in configs)
    if not windowed or not stream_kinds:
        return None
    return set(stream_kinds) != {FULL_ATTENTION}


def hit_unit_near_block_size(configs: Sequence[CacheConfig]) -> bool | None:
    results = []
    for config in configs:
        unit, block = (
            config_number(config, "effective_attention_block_size"),
            config_number(config, "block_size"),
        )
        if unit is None or not block:
            return None
        results.append(unit <= HIT_UNIT_FACTOR * block)
    return all(results) if results else None


def window_retention(configs: Sequence[CacheConfig], window_expired_tokens: float | None) -> bool | None:
    """window_expired_tokens: miss tokens of units whose window part was dropped, over the longest
    window (None: no stream shows a windowed group). Fails when some were and an engine keeps window
    parts for 0 seconds; passes without any; None while the interval is unknown."""
    if window_expired_tokens is None:
        return None
    if window_expired_tokens <= 0:
        return True
    intervals = [config_number(config, "prefix_cache_retention_interval") for config in configs]
    if not intervals or None in intervals:
        return None
    return all(interval > 0 for interval in intervals)
