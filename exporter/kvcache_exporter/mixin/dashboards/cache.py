"""kvcache-cache: the deep dive into the prefix cache, the block pool and the configuration."""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import units

from . import attribution
from .common import (
    BATCHES_PER_SECOND,
    TOKENS_PER_SECOND,
    Query,
    below_is_bad,
    dashboard,
    graph,
    grid,
    limits,
    rate,
    ratio,
    sel,
)

UID = "kvcache-cache"
HITS, QUERIES = "kvcache_prefix_cache_hit_tokens_total", "kvcache_prefix_cache_query_tokens_total"
HIT_ALERTS = ("KVCacheHitRatioBelowFloor", "KVCacheHitRatioDropped")
PASS_FAIL = {"1": ("pass", "green"), "0": ("fail", "red")}


def _prefix_cache():
    vllm_ratio = ratio(
        rate("vllm:prefix_cache_hits_total", "model_name"),
        rate("vllm:prefix_cache_queries_total", "model_name"),
    )
    return [
        graph(
            "Hit ratio from the token counters",
            Query(ratio(rate(HITS), rate(QUERIES)), "{{model_name}} (exporter)"),
            Query(vllm_ratio, "{{model_name}} (vLLM raw)"),
            shows="rate(hit tokens) / rate(queried tokens) over the dashboard's rate interval, from the "
            "exporter's normalized counters and from vLLM's own counters. Both lines should overlap.",
            action="vLLM raw present but exporter missing: a vLLM metric rename (check schema below). Both "
            "low: prompts stopped sharing prefixes, or blocks are evicted before reuse.",
            alerts=(*HIT_ALERTS, "KVCacheVLLMMetricsMissing", "KVCacheVLLMMetricsDeprecated"),
            unit=units.PercentUnit,
            thresholds=below_is_bad(limits().hit_ratio_floor),
        ),
        graph(
            "Queried and hit prompt tokens",
            Query(rate(QUERIES), "{{model_name}} queried"),
            Query(rate(HITS), "{{model_name}} hit"),
            shows="Prompt tokens looked up in, and served from, the prefix cache per second.",
            action="Queried falling to 0 means no traffic (ratios then show gaps, not 0).",
            alerts=HIT_ALERTS,
            unit=TOKENS_PER_SECOND,
        ),
        graph(
            "Prompt tokens: computed vs cached",
            Query(rate("kvcache_prompt_tokens_total", "source"), "{{source}}"),
            shows="Prompt tokens per second whose KV was computed (prefill work) or came from the cache.",
            action="Computed growing while traffic is flat means the cache stopped helping: see hit ratio.",
            alerts=HIT_ALERTS,
            unit=TOKENS_PER_SECOND,
            stacked=True,
        ),
        graph(
            "Hit ratio per model and engine",
            Query(ratio(rate(HITS, "model_name, engine"), rate(QUERIES, "model_name, engine"))),
            shows="The counter-based hit ratio broken down by model and data-parallel engine.",
            action="One engine far below the others: requests for a prefix are spread over engines "
            "(routing is not prefix-aware).",
            alerts=HIT_ALERTS,
            unit=units.PercentUnit,
            thresholds=below_is_bad(limits().hit_ratio_floor),
        ),
    ]


def _blocks():
    return [
        graph(
            "Block capacity and use",
            Query(sel("kvcache_blocks_capacity"), "{{model_name}}/{{engine}} capacity"),
            Query(sel("kvcache_blocks_in_use"), "{{model_name}}/{{engine}} in use"),
            shows="KV blocks vLLM allocated and blocks referenced by running requests.",
            action="In use touching capacity: vLLM preempts. Capacity lower than expected: check "
            "gpu_memory_utilization and the GPU memory budget.",
            alerts=("KVCacheSaturated",),
        ),
        graph(
            "Requests running and waiting",
            Query(sel("kvcache_requests_running"), "{{model_name}}/{{engine}} running"),
            Query(sel("kvcache_requests_waiting"), "{{model_name}}/{{engine}} waiting"),
            Query(
                rate("kvcache_preemptions_total", "model_name, engine"),
                "{{model_name}}/{{engine}} preempted/s",
                unit=units.OpsPerSecond,
            ),
            shows="The running batch, the queue, and preemptions per second.",
            action="A growing queue with blocks full is saturation: scale out.",
            alerts=("KVCacheSaturated", "KVCacheTimeToFirstTokenSLOBurn"),
        ),
        graph(
            "Fragmentation estimate",
            Query(sel("kvcache_block_fragmentation_estimate_ratio"), "{{model_name}}/{{engine}}"),
            shows="ESTIMATE of slots allocated but empty (the unfilled last block of each running request) "
            "over slots in use.",
            action="High with many short requests: a smaller block_size wastes less (at some kernel cost).",
            alerts=(
                "KVCachePrefixCachingDisabled",
                "KVCacheGPUMemoryUtilizationTooHigh",
                "KVCacheConfigCheckFailed",
            ),
            unit=units.PercentUnit,
            w=8,
        ),
        # Two panels: a block size (16-256) and a capacity (thousands of tokens) share no axis.
        graph(
            "Token capacity",
            Query(sel("kvcache_capacity_tokens"), "{{model_name}}/{{engine}} tokens"),
            shows="Tokens the KV cache can hold.",
            action="A sudden change means vLLM restarted with another configuration: see the config audit.",
            alerts=("KVCacheGPUMemoryUtilizationTooHigh", "KVCacheConfigCheckFailed"),
            w=4,
        ),
        graph(
            "Block size",
            Query(sel("kvcache_block_size_tokens"), "{{model_name}}/{{engine}} block size"),
            shows="Tokens per KV block: the unit the prefix cache hits in.",
            action="A sudden change means vLLM restarted with another configuration: see the config audit.",
            alerts=("KVCachePrefixCachingDisabled", "KVCacheConfigCheckFailed"),
            w=4,
        ),
        graph(
            "Cached blocks per the KV-event stream",
            Query(sel("kvcache_kv_events_cached_blocks"), "cached blocks"),
            Query(
                rate("kvcache_kv_events_missed_batches_total", ""),
                "missed batches/s",
                unit=BATCHES_PER_SECOND,
            ),
            shows="Blocks in vLLM's prefix-cache hash table according to KV events, and lost event batches.",
            action="Missed batches: the subscriber falls behind or vLLM restarted; the count is then off.",
            alerts=("KVCacheEventsMissed",),
            w=8,
        ),
    ]


def _audit():
    return [
        grid(
            "Configuration checks",
            Query(sel("kvcache_config_check")),
            shows="Each configuration check of the exporter per model: pass or fail.",
            action="Fix the failing check's vLLM flag (see docs/metrics.md for what each check means).",
            alerts=(
                "KVCachePrefixCachingDisabled",
                "KVCacheGPUMemoryUtilizationTooHigh",
                "KVCacheConfigCheckFailed",
            ),
            value_text=PASS_FAIL,
        ),
        grid(
            "vLLM cache configuration",
            Query(sel("kvcache_vllm_config_info")),
            shows="vLLM's cache configuration as the exporter read it from vllm:cache_config_info.",
            action="enable_prefix_caching false or an unexpected block_size: fix the vLLM command line.",
            alerts=(
                "KVCachePrefixCachingDisabled",
                "KVCacheGPUMemoryUtilizationTooHigh",
                "KVCacheConfigCheckFailed",
            ),
        ),
        grid(
            "vLLM metric schema",
            Query(sel("kvcache_vllm_schema_info")),
            Query(sel("kvcache_vllm_deprecated_metrics"), "deprecated"),
            Query(sel("kvcache_vllm_missing_metrics"), "missing"),
            shows="Which vLLM naming generation the target exposes, and how many deprecated or expected "
            "metric names the exporter found or missed.",
            action="Missing above 0 after a vLLM upgrade: a rename; update the exporter before panels empty.",
            alerts=(
                "KVCacheVLLMMetricsMissing",
                "KVCacheVLLMMetricsDeprecated",
            ),
        ),
        grid(
            "Collectors",
            Query(sel("kvcache_exporter_collector_success")),
            shows="1 when each of the exporter's collectors (vLLM, GPU, events) last ran successfully.",
            action="0: read the exporter's log and kvcache_exporter_errors_total's reason label.",
            alerts=("KVCacheCollectorFailing",),
            value_text={"1": ("ok", "green"), "0": ("failing", "red")},
        ),
    ]


def build() -> db.Dashboard:
    rows = {"Prefix cache": _prefix_cache(), "Blocks": _blocks(), "Config audit": _audit()}
    rows["Why is the cache missing?"] = attribution.panels()
    return dashboard(
        UID, "KV cache / Prefix cache and blocks", "Deep dive: prefix cache, blocks, config.", rows
    )
