"""The "Why is the cache missing?" row of kvcache-cache: the sidecar's miss attribution from vLLM's
KV events (docs/kv-events.md) beside vLLM's own residency and tier counters."""

from __future__ import annotations

from grafana_foundation_sdk.models import units

from ..palette import CAUSE_COLORS, LIVE_CAUSE_COLORS
from .common import RATE, TOKENS_PER_SECOND, WINDOW, Query, graph, ratio, sel

MISSES = sel("kvcache_prefix_cache_miss_tokens_total", 'replica=""')  # the aggregator's carry `replica`
ALERTS = ("KVCacheMissesFromDivergedPrefix", "KVCacheEvictionThrashing", "KVCacheMissAttributionIncomplete")


def _quantile(q: float, metric: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({sel(metric + '_bucket')}[{RATE}])))"


def panels():
    hits, queries = (
        f"sum(rate({sel(f'kvcache_prefix_cache_{kind}_tokens_total')}[{RATE}]))" for kind in ("hit", "query")
    )
    return [
        graph(
            "Miss tokens by cause",
            Query(f"sum by (cause) (rate({MISSES}[{RATE}]))", "{{cause}}"),
            shows="Prompt tokens vLLM computed per second (every BlockStored block), by why the cache did "
            "not have them (docs/kv-events.md, a section per cause; other_replica: the aggregator).",
            action="prefix_diverged: move the per-request fields after the shared part (see what the reorder "
            "is worth). evicted: the cache is too small (see the 2x/4x and host-tier estimates). "
            "history_rewritten: make the chat template reproduce generated turns verbatim. content_moved: "
            "sort tools/documents deterministically. window_expired: set --prefix-cache-retention-interval. "
            "below_hit_unit: make the shared part a whole hit unit. identity_isolated (adapter or salt) and "
            "restart: by design. cold: new content.",
            alerts=ALERTS,
            unit=TOKENS_PER_SECOND,
            stacked=True,
            colors=CAUSE_COLORS | LIVE_CAUSE_COLORS,
        ),
        graph(
            "Where the shared content starts (divergence offset)",
            Query(_quantile(0.5, "kvcache_prefix_divergence_offset_tokens"), "median"),
            Query(_quantile(0.9, "kvcache_prefix_divergence_offset_tokens"), "p90"),
            shows="For prompts whose prefix diverged: how many tokens of per-request front matter come "
            "before content the cache already holds (kvcache_prefix_divergence_offset_tokens).",
            action="A steady offset is the length of the fields placed first (user id, timestamp, order "
            "number): move them after the static part and keep that part byte-identical.",
            alerts=ALERTS[:1],
        ),
        graph(
            "Hit ratio: real vs each fix (reorder, 2x / 4x the KV cache, a host tier)",
            Query(ratio(hits, queries), "real"),
            Query(
                f"max({sel('kvcache_prefix_cache_hit_ratio_reordered_estimate', WINDOW)})",
                "per-request fields after the shared part (estimate)",
            ),
            Query(
                f"max by (capacity_factor) ({sel('kvcache_prefix_cache_hit_ratio_estimate', WINDOW)})",
                "{{capacity_factor}}x KV cache (estimate)",
            ),
            Query(
                f"max({sel('kvcache_prefix_cache_hit_ratio_host_tier_estimate', WINDOW)})",
                "with the host tier (estimate)",
            ),
            shows="The real hit ratio and the exporter's estimates over the $window window: had the "
            "per-request fields come after the shared part (the prefix_diverged tokens would have hit), had "
            "the KV cache been 2x or 4x larger, or with the host (CPU) tier of --whatif.host-tier-bytes "
            "(docs/kv-events.md gives each one's bias).",
            action="The highest line is the fix worth most: reorder the prompt, or buy memory (raise "
            "gpu_memory_utilization, fewer sequences, more replicas, a host tier). No gap: nothing to win.",
            alerts=ALERTS[:2],
            unit=units.PercentUnit,
        ),
        graph(
            "Attribution coverage",
            Query(f"max({sel('kvcache_prefix_cache_miss_attribution_coverage_ratio', WINDOW)})", "coverage"),
            shows="Share of the prompt tokens vLLM computed (queries - hits) that the KV-event stream "
            "attributed to a cause over $window. Each prompt's last partial block is never stored, so it "
            "sits a little below 1.",
            action="Well below 1: batches were lost or dropped (kvcache_kv_events_*), or events are off; "
            "trust the causes above only as far as this goes.",
            alerts=ALERTS[2:],
            unit=units.PercentUnit,
        ),
        graph(
            "Block residency (vLLM --kv-cache-metrics)",
            Query(_quantile(0.5, "vllm:kv_block_idle_before_evict_seconds"), "idle before eviction p50"),
            Query(_quantile(0.5, "vllm:kv_block_reuse_gap_seconds"), "reuse gap p50"),
            Query(_quantile(0.5, "vllm:kv_block_lifetime_seconds"), "lifetime p50"),
            shows="vLLM's sampled block residency: how long evicted blocks sat idle, the gap between reuses "
            "of a block, and block lifetime (medians over the rate interval).",
            action="Idle-before-eviction below the reuse gap: blocks are evicted before they would be "
            "reused, the cache is too small for this traffic.",
            alerts=ALERTS[1:2],
            unit=units.Seconds,
        ),
        graph(
            "Cache hits by tier",
            Query(
                f"sum by (source) (rate({sel('vllm:prompt_tokens_cached_by_source_total')}[{RATE}]))",
                "{{source}}",
            ),
            shows="Prompt tokens served from a cache per second, by the tier that supplied them (device HBM, "
            "host DRAM, disk, p2p from another instance; vllm:prompt_tokens_cached_by_source_total).",
            action="Hits moving from device to host/disk: the device cache is too small and the offload tier "
            "is carrying the load (slower).",
            alerts=ALERTS[1:2],
            unit=TOKENS_PER_SECOND,
            stacked=True,
        ),
    ]
