"""vLLM's metric names across its generations, mapped to the exporter's logical quantities.

See ../shared/reference/vllm-metrics.md: V1 current names, the deprecated V1 names
(gpu_prefix_cache_*, gpu_cache_usage_perc), V0 names, and the `ray_vllm:` prefix.
Candidates are tried in order; the first one present wins.
"""

from __future__ import annotations

COUNTERS: dict[str, tuple[str, ...]] = {
    "query_tokens": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "hit_tokens": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "prompt_tokens": ("vllm:prompt_tokens_total",),
    "generation_tokens": ("vllm:generation_tokens_total",),
    "preemptions": ("vllm:num_preemptions_total",),
    "external_query_tokens": ("vllm:external_prefix_cache_queries_total",),
    "external_hit_tokens": ("vllm:external_prefix_cache_hits_total",),
    # KV offloading (vLLM 0.33: offloading connector, else the multi-tier family); derive/offload.py
    "offload_load_bytes": ("vllm:kv_offload_load_bytes_total", "vllm:kv_offload_tiering_read_bytes_total"),
    "offload_load_seconds": ("vllm:kv_offload_load_time_total", "vllm:kv_offload_tiering_read_time_total"),
    "offload_store_bytes": ("vllm:kv_offload_store_bytes_total", "vllm:kv_offload_tiering_write_bytes_total"),
    "offload_store_seconds": ("vllm:kv_offload_store_time_total", "vllm:kv_offload_tiering_write_time_total"),
    "offload_allocation_failures": ("vllm:kv_offload_allocation_failure_total",),
    "offload_stores_skipped": ("vllm:kv_offload_stores_skipped_total",),
}

# Labelled families read per label value, for a fixed set of values only (no unbounded labels):
# logical key = prefix + value.
CACHED_BY_TIER = "vllm:prompt_tokens_cached_by_source_total"  # hits by the tier that supplied them
TIERS = ("device", "host", "disk", "p2p", "external_unspecified")
WAITING_BY_REASON = "vllm:num_requests_waiting_by_reason"
WAITING_REASONS = ("capacity", "deferred")
# Counted by the API server, not per engine (no engine label): read as engine "0".
ADMISSION_REJECTIONS = "vllm:admission_rejections_total"
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")

# prompt_tokens_by_source{source="local_compute"}: the prompt tokens that were really prefilled.
PROMPT_BY_SOURCE = "vllm:prompt_tokens_by_source_total"
COMPUTED_SOURCE = "local_compute"

GAUGES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "running": ("vllm:num_requests_running",),
    "waiting": ("vllm:num_requests_waiting",),
    "v0_block_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
}

# Gauges that are ratios: several series for one (model, engine) are averaged, the rest summed.
RATIO_GAUGES = frozenset({"kv_usage", "v0_block_hit_rate"})

HISTOGRAMS: dict[str, str] = {
    "ttft": "vllm:time_to_first_token_seconds",
    "prefill": "vllm:request_prefill_time_seconds",
    "decode": "vllm:request_decode_time_seconds",
    "queue": "vllm:request_queue_time_seconds",
    "e2e": "vllm:e2e_request_latency_seconds",
    # optional (vLLM 0.32 with --kv-cache-metrics; prefill_kv_computed always): never "missing"
    "block_lifetime": "vllm:kv_block_lifetime_seconds",
    "block_idle_before_evict": "vllm:kv_block_idle_before_evict_seconds",
    "block_reuse_gap": "vllm:kv_block_reuse_gap_seconds",
    "prefill_kv_computed": "vllm:request_prefill_kv_computed_tokens",
}

CACHE_CONFIG = "vllm:cache_config_info"
CREATED = "vllm:prefix_cache_queries_created"
PROCESS_START = "process_start_time_seconds"

DEPRECATED = frozenset(
    {
        "vllm:gpu_prefix_cache_queries_total",
        "vllm:gpu_prefix_cache_hits_total",
        "vllm:gpu_cache_usage_perc",
        "vllm:cpu_cache_usage_perc",
        "vllm:gpu_prefix_cache_hit_rate",
        "vllm:cpu_prefix_cache_hit_rate",
        "vllm:num_requests_swapped",
        "vllm:time_per_output_token_seconds_count",
        "vllm:time_in_queue_requests_count",
        "vllm:avg_prompt_throughput_toks_per_s",
        "vllm:avg_generation_throughput_toks_per_s",
    }
)

# What each generation is expected to expose; a missing one is counted, never silently zeroed.
EXPECTED_V1 = ("query_tokens", "hit_tokens", "kv_usage", "running", "waiting", "prompt_tokens",
               "generation_tokens", "ttft", "prefill", "cache_config")  # fmt: skip
EXPECTED_V0 = ("kv_usage", "running", "waiting", "prompt_tokens", "generation_tokens", "ttft", "cache_config")


def schema_of(names: set[str]) -> str:
    """The naming generation a scrape uses (names already stripped of the Ray prefix)."""
    if "vllm:prefix_cache_queries_total" in names or "vllm:kv_cache_usage_perc" in names:
        return "v1"
    if "vllm:gpu_prefix_cache_queries_total" in names:
        return "v1-deprecated"
    if any(n.startswith("vllm:") for n in names):
        return "v0"
    return "unknown"
