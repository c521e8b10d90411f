"""Every metric the exporter serves, declared once.

docs/metrics.md is generated from this table (`kvcache-exporter docs`); alerts and
dashboards are tested against it. Label sets are the base labels: with more than one
vLLM target every vLLM-derived series also carries `target`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ME = ("model_name", "engine")
GPU = ("gpu", "uuid", "name")


@dataclass(frozen=True)
class Metric:
    name: str
    # counter | gauge | histogram | summary (windowed quantiles: promtool wants `quantile` only on summaries)
    type: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    group: str = "cache"
    source: str = ""  # the vLLM/GPU inputs
    formula: str = ""
    per_target: bool = True  # gets a `target` label when several vLLM targets are polled
    allowed: tuple[float, float] | None = None  # values a sample may take; default from the unit

    @property
    def value_range(self) -> tuple[float, float]:
        """Outside it a sample is a bug or bad input: guard.py drops it. Ratios are 0-1, temperatures
        any finite number, everything else (counts, rates, bytes, seconds, money) non-negative."""
        if self.allowed is not None:
            return self.allowed
        if self.unit == "ratio":
            return (0.0, 1.0)
        return (-math.inf, math.inf) if self.unit == "celsius" else (0.0, math.inf)


_NOT_PER_TARGET = {"gpu", "memory", "cost", "events", "fleet", "attribution"}


def _m(*args, **kwargs) -> Metric:
    metric = Metric(*args, **kwargs)
    if metric.group in _NOT_PER_TARGET and "per_target" not in kwargs:
        metric = Metric(*args, **{**kwargs, "per_target": False})
    return metric


# Every name as a constant: call sites use these, so a typo fails at import or in a unit test.
PREFIX_CACHE_QUERY_TOKENS_TOTAL = "kvcache_prefix_cache_query_tokens_total"
PREFIX_CACHE_HIT_TOKENS_TOTAL = "kvcache_prefix_cache_hit_tokens_total"
PREFIX_CACHE_HIT_RATIO = "kvcache_prefix_cache_hit_ratio"
VLLM_V0_PREFIX_CACHE_BLOCK_HIT_RATIO = "kvcache_vllm_v0_prefix_cache_block_hit_ratio"
PROMPT_TOKENS_TOTAL = "kvcache_prompt_tokens_total"
PROMPT_TOKENS_PER_SECOND = "kvcache_prompt_tokens_per_second"
GENERATION_TOKENS_TOTAL = "kvcache_generation_tokens_total"
GENERATION_TOKENS_PER_SECOND = "kvcache_generation_tokens_per_second"
PREEMPTIONS_TOTAL = "kvcache_preemptions_total"
PREEMPTIONS_PER_SECOND = "kvcache_preemptions_per_second"
BLOCK_UTILIZATION_RATIO = "kvcache_block_utilization_ratio"
BLOCKS_CAPACITY = "kvcache_blocks_capacity"
BLOCKS_IN_USE = "kvcache_blocks_in_use"
BLOCK_SIZE_TOKENS = "kvcache_block_size_tokens"
CAPACITY_TOKENS = "kvcache_capacity_tokens"
BLOCK_FRAGMENTATION_ESTIMATE_RATIO = "kvcache_block_fragmentation_estimate_ratio"
REQUESTS_RUNNING = "kvcache_requests_running"
REQUESTS_WAITING = "kvcache_requests_waiting"
VLLM_CONFIG_INFO = "kvcache_vllm_config_info"
PREFILL_LATENCY_SECONDS = "kvcache_prefill_latency_seconds"
TIME_TO_FIRST_TOKEN_SECONDS = "kvcache_time_to_first_token_seconds"
QUEUE_TIME_SECONDS = "kvcache_queue_time_seconds"
E2E_LATENCY_SECONDS = "kvcache_e2e_latency_seconds"
GPU_MEMORY_USED_BYTES = "kvcache_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = "kvcache_gpu_memory_total_bytes"
GPU_UTILIZATION_RATIO = "kvcache_gpu_utilization_ratio"
GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO = "kvcache_gpu_memory_bandwidth_utilization_ratio"
GPU_POWER_WATTS = "kvcache_gpu_power_watts"
GPU_ENERGY_JOULES_TOTAL = "kvcache_gpu_energy_joules_total"
GPU_TEMPERATURE_CELSIUS = "kvcache_gpu_temperature_celsius"
GPU_PROCESS_MEMORY_USED_BYTES = "kvcache_gpu_process_memory_used_bytes"
GPU_MEMORY_BUDGET_BYTES = "kvcache_gpu_memory_budget_bytes"
GPU_MEMORY_BUDGET_USAGE_RATIO = "kvcache_gpu_memory_budget_usage_ratio"
GPU_MEMORY_HEADROOM_RATIO = "kvcache_gpu_memory_headroom_ratio"
GPU_MEMORY_SWING_BYTES = "kvcache_gpu_memory_swing_bytes"
CONFIG_CHECK = "kvcache_config_check"
COST_INFO = "kvcache_cost_info"
GPU_COST_PER_HOUR = "kvcache_gpu_cost_per_hour"
COST_PER_MILLION_TOKENS = "kvcache_cost_per_million_tokens"
CACHE_SAVINGS_PER_HOUR = "kvcache_cache_savings_per_hour"
CACHE_MISS_EXTRA_COST_PER_HOUR = "kvcache_cache_miss_extra_cost_per_hour"
ENERGY_JOULES_PER_TOKEN = "kvcache_energy_joules_per_token"
ENERGY_COST_PER_MILLION_TOKENS = "kvcache_energy_cost_per_million_tokens"
KV_EVENTS_BATCHES_TOTAL = "kvcache_kv_events_batches_total"
KV_EVENTS_TOTAL = "kvcache_kv_events_total"
KV_EVENTS_MISSED_BATCHES_TOTAL = "kvcache_kv_events_missed_batches_total"
KV_EVENTS_PUBLISHER_RESTARTS_TOTAL = "kvcache_kv_events_publisher_restarts_total"
KV_EVENTS_DROPPED_TOTAL = "kvcache_kv_events_dropped_total"
KV_EVENTS_CACHED_BLOCKS = "kvcache_kv_events_cached_blocks"
KV_EVENTS_DISCOVERED_ENDPOINTS = "kvcache_kv_events_discovered_endpoints"
KV_EVENTS_DISCOVERY_STATE = "kvcache_kv_events_discovery_state"
KV_EVENTS_DISCOVERY_REJECTED = "kvcache_kv_events_discovery_rejected"
KV_EVENTS_DISCOVERY_CHANGES_TOTAL = "kvcache_kv_events_discovery_changes_total"
KV_EVENTS_GROUP_INFO = "kvcache_kv_events_group_info"
KV_EVENTS_PUBLISHER_STATE = "kvcache_kv_events_publisher_state"
OFFLOAD_BYTES_PER_SECOND = "kvcache_offload_bytes_per_second"
OFFLOAD_BUSY_RATIO = "kvcache_offload_busy_ratio"
OFFLOAD_HOST_HIT_RATIO = "kvcache_offload_host_hit_ratio"
OFFLOAD_STORES_WITHOUT_LOADS = "kvcache_offload_stores_without_loads"
OFFLOAD_ALLOCATION_FAILURES_TOTAL = "kvcache_offload_allocation_failures_total"
OFFLOAD_STORES_SKIPPED_TOTAL = "kvcache_offload_stores_skipped_total"
KV_EVENTS_HIT_UNIT_TOKENS = "kvcache_kv_events_hit_unit_tokens"
KV_EVENTS_STORED_TOKENS_TOTAL = "kvcache_kv_events_stored_tokens_total"
KV_EVENTS_REUSED_TOKENS_TOTAL = "kvcache_kv_events_reused_tokens_total"
KV_EVENTS_SESSION_TOKENS_TOTAL = "kvcache_kv_events_session_tokens_total"
KV_EVENTS_SESSION_ID_RATIO = "kvcache_kv_events_session_id_ratio"
KV_EVENTS_WINDOW_EVICTIONS_TOTAL = "kvcache_kv_events_window_evictions_total"
KV_EVENTS_TIER_BLOCKS = "kvcache_kv_events_tier_blocks"
KV_EVENTS_TIER_BYTES = "kvcache_kv_events_tier_bytes"
KV_EVENTS_TIER_HIT_TOKENS_TOTAL = "kvcache_kv_events_tier_hit_tokens_total"
VLLM_UP = "kvcache_vllm_up"
VLLM_SCHEMA_INFO = "kvcache_vllm_schema_info"
VLLM_DEPRECATED_METRICS = "kvcache_vllm_deprecated_metrics"
VLLM_MISSING_METRICS = "kvcache_vllm_missing_metrics"
EXPORTER_COLLECTOR_SUCCESS = "kvcache_exporter_collector_success"
EXPORTER_COLLECTOR_DURATION_SECONDS = "kvcache_exporter_collector_duration_seconds"
EXPORTER_LAST_SUCCESS_TIMESTAMP_SECONDS = "kvcache_exporter_last_success_timestamp_seconds"
EXPORTER_ERRORS_TOTAL = "kvcache_exporter_errors_total"
EXPORTER_HTTP_REJECTED_TOTAL = "kvcache_exporter_http_rejected_total"
EXPORTER_BUILD_INFO = "kvcache_exporter_build_info"
PREFIX_CACHE_MISS_TOKENS_TOTAL = "kvcache_prefix_cache_miss_tokens_total"
PREFIX_CACHE_REORDER_HIT_TOKENS_TOTAL = "kvcache_prefix_cache_reorder_hit_tokens_total"
KV_BLOCK_LIFETIME_SECONDS = "kvcache_kv_block_lifetime_seconds"
KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS = "kvcache_kv_block_idle_before_evict_seconds"
KV_BLOCK_REUSE_GAP_SECONDS = "kvcache_kv_block_reuse_gap_seconds"
PREFILL_COMPUTED_TOKENS = "kvcache_prefill_computed_tokens"
PROMPT_TOKENS_CACHED_BY_TIER_TOTAL = "kvcache_prompt_tokens_cached_by_tier_total"
EVICTED_TOKENS_TOTAL = "kvcache_evicted_tokens_total"
TIER_LOAD_BACK_TOKENS_TOTAL = "kvcache_tier_load_back_tokens_total"
TIER_BACKUP_TOKENS_TOTAL = "kvcache_tier_backup_tokens_total"
REQUESTS_WAITING_BY_REASON = "kvcache_requests_waiting_by_reason"
ADMISSION_REJECTIONS_TOTAL = "kvcache_admission_rejections_total"
EXTERNAL_PREFIX_CACHE_QUERY_TOKENS_TOTAL = "kvcache_external_prefix_cache_query_tokens_total"
EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL = "kvcache_external_prefix_cache_hit_tokens_total"
KV_EVENTS_DECODE_TOKENS_TOTAL = "kvcache_kv_events_decode_tokens_total"
PREFIX_DIVERGENCE_OFFSET_TOKENS = "kvcache_prefix_divergence_offset_tokens"
PREFIX_DIVERGED_FIELD_TOKENS_TOTAL = "kvcache_prefix_diverged_field_tokens_total"
PREFIX_HISTORY_REWRITTEN_TURN = "kvcache_prefix_history_rewritten_turn"
PREFIX_CACHE_MISS_ATTRIBUTION_COVERAGE_RATIO = "kvcache_prefix_cache_miss_attribution_coverage_ratio"
PREFIX_CACHE_MISS_ATTRIBUTION_EXCESS_TOKENS = "kvcache_prefix_cache_miss_attribution_excess_tokens"
PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED = "kvcache_prefix_cache_miss_attribution_tracked"
PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED_LIMIT = "kvcache_prefix_cache_miss_attribution_tracked_limit"
PREFIX_CACHE_HIT_RATIO_ESTIMATE = "kvcache_prefix_cache_hit_ratio_estimate"
PREFIX_CACHE_HIT_RATIO_REORDERED_ESTIMATE = "kvcache_prefix_cache_hit_ratio_reordered_estimate"
PREFIX_CACHE_HIT_RATIO_REORDERED_LAYOUT_ESTIMATE = "kvcache_prefix_cache_hit_ratio_reordered_layout_estimate"
PREFIX_CACHE_HIT_RATIO_HOST_TIER_ESTIMATE = "kvcache_prefix_cache_hit_ratio_host_tier_estimate"
HOST_TIER_LOAD_BYTES_PER_SECOND_ESTIMATE = "kvcache_host_tier_load_bytes_per_second_estimate"
FLEET_STORED_TOKENS_TOTAL = "kvcache_fleet_stored_tokens_total"
FLEET_QUERY_TOKENS_TOTAL = "kvcache_fleet_query_tokens_total"
FLEET_HIT_TOKENS_TOTAL = "kvcache_fleet_hit_tokens_total"
FLEET_RESIDENT_BLOCKS = "kvcache_fleet_resident_blocks"
FLEET_UNTRACKED_BLOCKS_TOTAL = "kvcache_fleet_untracked_blocks_total"
FLEET_REPLICA_RESTARTS_TOTAL = "kvcache_fleet_replica_restarts_total"
FLEET_DISTINCT_BLOCKS = "kvcache_fleet_distinct_blocks"
FLEET_DUPLICATE_BLOCKS = "kvcache_fleet_duplicate_blocks"
FLEET_DUPLICATE_BLOCKS_RATIO = "kvcache_fleet_duplicate_blocks_ratio"
FLEET_HIT_RATIO = "kvcache_fleet_hit_ratio"
FLEET_HIT_RATIO_ESTIMATE = "kvcache_fleet_hit_ratio_estimate"
FLEET_HASH_SAMPLING_RATIO = "kvcache_fleet_hash_sampling_ratio"
FLEET_SESSIONS = "kvcache_fleet_sessions"
FLEET_SESSIONS_SPLIT = "kvcache_fleet_sessions_split"
FLEET_SESSIONS_SPLIT_RATIO = "kvcache_fleet_sessions_split_ratio"
FLEET_REPLICAS = "kvcache_fleet_replicas"
FLEET_REPLICAS_LEFT_OUT = "kvcache_fleet_replicas_left_out"
FLEET_PUBLISHED_TOTAL = "kvcache_fleet_published_total"
FLEET_PUBLISH_DROPPED_TOTAL = "kvcache_fleet_publish_dropped_total"
FLEET_PUBLISH_BUFFERED = "kvcache_fleet_publish_buffered"
FLEET_PUBLISH_LAG_SECONDS = "kvcache_fleet_publish_lag_seconds"
FLEET_PUBLISH_RESYNCS_TOTAL = "kvcache_fleet_publish_resyncs_total"
FLEET_PUBLISH_RESYNCED_BLOCKS_TOTAL = "kvcache_fleet_publish_resynced_blocks_total"
FLEET_PUBLISH_RESYNC_PENDING = "kvcache_fleet_publish_resync_pending"
FLEET_DELTAS_TOTAL = "kvcache_fleet_deltas_total"
FLEET_DELTAS_DROPPED_TOTAL = "kvcache_fleet_deltas_dropped_total"
FLEET_CONSUMER_PENDING = "kvcache_fleet_consumer_pending"
FLEET_CONSUMER_REDELIVERED_TOTAL = "kvcache_fleet_consumer_redelivered_total"


CATALOG: tuple[Metric, ...] = (
    # --- prefix cache ---------------------------------------------------------------
    _m(
        PREFIX_CACHE_QUERY_TOKENS_TOTAL,
        "counter",
        "Prompt tokens looked up in vLLM's prefix cache, normalized across vLLM versions.",
        ME,
        "tokens",
        source="vllm:prefix_cache_queries_total; vllm:gpu_prefix_cache_queries_total (blocks x block_size "
        "when its HELP says blocks)",
        formula="copied (reset-safe: it resets when vLLM restarts, like vLLM's own counter)",
    ),
    _m(
        PREFIX_CACHE_HIT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens served from vLLM's prefix cache, normalized across vLLM versions.",
        ME,
        "tokens",
        source="vllm:prefix_cache_hits_total; vllm:gpu_prefix_cache_hits_total",
        formula="copied",
    ),
    _m(
        PREFIX_CACHE_HIT_RATIO,
        "gauge",
        "Share of queried prompt tokens that hit the prefix cache over the window; absent when the window "
        "saw no queries.",
        (*ME, "window"),
        "ratio",
        source="vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total",
        formula="increase(hits)/increase(queries) over the window, counter resets handled like rate()",
    ),
    _m(
        VLLM_V0_PREFIX_CACHE_BLOCK_HIT_RATIO,
        "gauge",
        "V0 engines only: vLLM's own lifetime block hit-rate gauge (no token counters exist in V0).",
        ME,
        "ratio",
        source="vllm:gpu_prefix_cache_hit_rate",
        formula="copied; the -1 that V0 reports when prefix caching is off is dropped",
    ),
    _m(
        PROMPT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens by where their KV came from: computed (prefill work) or cached (prefix-cache hit).",
        (*ME, "source"),
        "tokens",
        source="vllm:prompt_tokens_by_source_total, else vllm:prompt_tokens_total - prefix cache hits",
        formula="computed = local_compute; cached = local_cache_hit + external_kv_transfer",
    ),
    _m(
        PROMPT_TOKENS_PER_SECOND,
        "gauge",
        "Prompt tokens per second over the window, computed vs cached.",
        (*ME, "source", "window"),
        "tokens/s",
        source=PROMPT_TOKENS_TOTAL,
        formula="increase/window duration",
    ),
    _m(
        GENERATION_TOKENS_TOTAL,
        "counter",
        "Generated (decode) tokens.",
        ME,
        "tokens",
        source="vllm:generation_tokens_total",
        formula="copied",
    ),
    _m(
        GENERATION_TOKENS_PER_SECOND,
        "gauge",
        "Generated tokens per second over the window.",
        (*ME, "window"),
        "tokens/s",
        source="vllm:generation_tokens_total",
        formula="increase/window duration",
    ),
    _m(
        PREEMPTIONS_TOTAL,
        "counter",
        "Requests preempted because KV blocks ran out.",
        ME,
        source="vllm:num_preemptions_total",
        formula="copied",
    ),
    _m(
        PREEMPTIONS_PER_SECOND,
        "gauge",
        "Preemptions per second over the window.",
        (*ME, "window"),
        "1/s",
        source="vllm:num_preemptions_total",
        formula="increase/window duration",
    ),
    # --- blocks ---------------------------------------------------------------------
    _m(
        BLOCK_UTILIZATION_RATIO,
        "gauge",
        "Share of KV blocks referenced by running requests (evictable cached blocks count as free).",
        ME,
        "ratio",
        source="vllm:kv_cache_usage_perc (0-1); vllm:gpu_cache_usage_perc",
        formula="copied, clamped to 0-1",
        group="blocks",
    ),
    _m(
        BLOCKS_CAPACITY,
        "gauge",
        "KV blocks vLLM allocated for this engine.",
        ME,
        "blocks",
        source="vllm:cache_config_info{num_gpu_blocks}",
        formula="num_gpu_blocks",
        group="blocks",
    ),
    _m(
        BLOCKS_IN_USE,
        "gauge",
        "KV blocks referenced by running requests.",
        ME,
        "blocks",
        source="vllm:kv_cache_usage_perc, vllm:cache_config_info{num_gpu_blocks}",
        formula="utilization x (num_gpu_blocks - 1), the null block excluded as vLLM does",
        group="blocks",
    ),
    _m(
        BLOCK_SIZE_TOKENS,
        "gauge",
        "Tokens per KV block.",
        ME,
        "tokens",
        source="vllm:cache_config_info{block_size}",
        formula="block_size",
        group="blocks",
    ),
    _m(
        CAPACITY_TOKENS,
        "gauge",
        "Tokens the KV cache can hold.",
        ME,
        "tokens",
        source="vllm:cache_config_info{kv_cache_size_tokens}, else num_gpu_blocks x block_size",
        formula="kv_cache_size_tokens or num_gpu_blocks x block_size",
        group="blocks",
    ),
    _m(
        BLOCK_FRAGMENTATION_ESTIMATE_RATIO,
        "gauge",
        "ESTIMATE of KV slots allocated but holding no token (the unfilled tail of each running sequence's "
        "last block) over slots in use.",
        ME,
        "ratio",
        source="block size, blocks in use, vllm:num_requests_running",
        formula="running x (block_size - 1) / 2 / (blocks_in_use x block_size), capped at 1 (see docs)",
        group="blocks",
    ),
    _m(
        REQUESTS_RUNNING,
        "gauge",
        "Requests in the model's running batch.",
        ME,
        source="vllm:num_requests_running",
        formula="copied",
        group="blocks",
    ),
    _m(
        REQUESTS_WAITING,
        "gauge",
        "Requests waiting to be scheduled.",
        ME,
        source="vllm:num_requests_waiting",
        formula="copied",
        group="blocks",
    ),
    _m(
        VLLM_CONFIG_INFO,
        "gauge",
        "vLLM's cache configuration (value 1), the labels that matter for the cache.",
        (
            "model_name",
            "engine",
            "block_size",
            "num_gpu_blocks",
            "enable_prefix_caching",
            "gpu_memory_utilization",
            "cache_dtype",
            "prefix_caching_hash_algo",
            "prefix_cache_retention_interval",
        ),
        source="vllm:cache_config_info",
        formula="labels copied; model_name joined from the engine's other series",
        group="config",
    ),
    # --- latency --------------------------------------------------------------------
    *(
        _m(
            name,
            "summary",
            f"{what} over the window: quantiles from histogram bucket deltas (PromQL histogram_quantile "
            "interpolation); _count and _sum are the requests and seconds observed in the window "
            "(not cumulative). Absent when no request finished in the window.",
            (*ME, "quantile", "window"),
            "seconds",
            source=src,
            formula="histogram_quantile(q, increase(buckets over window))",
            group="latency",
        )
        for name, what, src in (
            (PREFILL_LATENCY_SECONDS, "Prefill time", "vllm:request_prefill_time_seconds"),
            (
                TIME_TO_FIRST_TOKEN_SECONDS,
                "Time to first token",
                "vllm:time_to_first_token_seconds",
            ),
            (QUEUE_TIME_SECONDS, "Queue time", "vllm:request_queue_time_seconds"),
            (E2E_LATENCY_SECONDS, "End-to-end request latency", "vllm:e2e_request_latency_seconds"),
        )
    ),
    _m(
        PROMPT_TOKENS_CACHED_BY_TIER_TOTAL,
        "counter",
        "Prompt tokens served from a cache, by the tier that supplied them: device (HBM), host (DRAM), "
        "disk, p2p (another vLLM instance), external_unspecified.",
        (*ME, "tier"),
        "tokens",
        "cache",
        "vllm:prompt_tokens_cached_by_source_total{source}",
        "copied; tier = vLLM's source label (known values only), or SGLang's cache_source "
        "(device, host, storage)",
    ),
    _m(
        EVICTED_TOKENS_TOTAL,
        "counter",
        "Tokens the engine's radix tree evicted from the device pool (SGLang only; with HiCache they may "
        "still be held on the host).",
        ME,
        "tokens",
        "sglang",
        "sglang:evicted_tokens_total",
        "copied (tensor-parallel rank 0)",
    ),
    _m(
        TIER_LOAD_BACK_TOKENS_TOTAL,
        "counter",
        "Tokens loaded back from the host tier into the device pool (SGLang HiCache only).",
        ME,
        "tokens",
        "sglang",
        "sglang:load_back_tokens_total",
        "copied (tensor-parallel rank 0)",
    ),
    _m(
        TIER_BACKUP_TOKENS_TOTAL,
        "counter",
        "Tokens written to the host tier (SGLang HiCache only; write-through: every device store).",
        ME,
        "tokens",
        "sglang",
        "sglang:hicache_backup_tokens_total",
        "copied (tensor-parallel rank 0)",
    ),
    _m(
        REQUESTS_WAITING_BY_REASON,
        "gauge",
        "Waiting requests by why they wait: capacity (no KV blocks or batch slot), deferred (LoRA budget, "
        "KV transfer, blocked). They sum to kvcache_requests_waiting.",
        (*ME, "reason"),
        "requests",
        "cache",
        "vllm:num_requests_waiting_by_reason",
        "copied",
    ),
    _m(
        ADMISSION_REJECTIONS_TOTAL,
        "counter",
        "Requests vLLM refused at admission because a queue limit was reached (max_num_queued_reqs, "
        "max_num_queued_tokens): load the cache never saw. Counted by the API server, so on engine 0.",
        (*ME, "reason"),
        "requests",
        "cache",
        "vllm:admission_rejections_total{reason}",
        "copied; engine is 0 (vLLM's series has no engine label)",
    ),
    # --- block residency (vLLM --kv-cache-metrics, sampled) ---------------------------------
    *(
        _m(
            name,
            "summary",
            f"{what} over the window (vLLM samples blocks: --kv-cache-metrics-sample): quantiles from "
            "histogram bucket deltas; _count and _sum are the blocks and seconds observed in the window. "
            "Absent without --kv-cache-metrics.",
            (*ME, "quantile", "window"),
            "seconds",
            "blocks",
            src,
            "histogram_quantile(q, increase(buckets over window))",
        )
        for name, what, src in (
            (
                KV_BLOCK_LIFETIME_SECONDS,
                "KV block lifetime, allocation to eviction",
                "vllm:kv_block_lifetime_seconds",
            ),
            (
                KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS,
                "Idle time of KV blocks before their eviction",
                "vllm:kv_block_idle_before_evict_seconds",
            ),
            (
                KV_BLOCK_REUSE_GAP_SECONDS,
                "Time between consecutive accesses of a KV block",
                "vllm:kv_block_reuse_gap_seconds",
            ),
        )
    ),
    _m(
        PREFILL_COMPUTED_TOKENS,
        "summary",
        "New KV tokens each finished request computed during prefill (its prompt minus cached tokens), over "
        "the window: quantiles from histogram bucket deltas; _count is requests, _sum tokens.",
        (*ME, "quantile", "window"),
        "tokens",
        "cache",
        "vllm:request_prefill_kv_computed_tokens",
        "histogram_quantile(q, increase(buckets over window))",
    ),
    *(
        _m(
            name,
            "counter",
            f"Prompt tokens {what} a KV connector's cross-instance cache (0 without a connector); their "
            "ratio over a window is the connector's hit ratio.",
            ME,
            "tokens",
            "cache",
            src,
            "copied; since vLLM PR #30522 queries count only the tokens asked of the connector",
        )
        for name, what, src in (
            (
                EXTERNAL_PREFIX_CACHE_QUERY_TOKENS_TOTAL,
                "looked up in",
                "vllm:external_prefix_cache_queries_total",
            ),
            (EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL, "served from", "vllm:external_prefix_cache_hits_total"),
        )
    ),
    # --- GPU --------------------------------------------------------------------------
    _m(GPU_MEMORY_USED_BYTES, "gauge", "GPU memory in use.", GPU, "bytes", "gpu", "NVML or DCGM"),
    _m(GPU_MEMORY_TOTAL_BYTES, "gauge", "GPU memory in total.", GPU, "bytes", "gpu", "NVML or DCGM"),
    _m(
        GPU_UTILIZATION_RATIO,
        "gauge",
        "GPU (SM) utilization, 0-1.",
        GPU,
        "ratio",
        "gpu",
        "NVML or DCGM",
    ),
    _m(
        GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO,
        "gauge",
        "Memory-controller utilization, 0-1.",
        GPU,
        "ratio",
        "gpu",
        "NVML or DCGM",
    ),
    _m(GPU_POWER_WATTS, "gauge", "Power draw.", GPU, "watts", "gpu", "NVML or DCGM"),
    _m(
        GPU_ENERGY_JOULES_TOTAL,
        "counter",
        "Energy consumed since the driver loaded.",
        GPU,
        "joules",
        "gpu",
        "NVML total energy (mJ) or DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)",
        "mJ / 1000",
    ),
    _m(GPU_TEMPERATURE_CELSIUS, "gauge", "GPU temperature.", GPU, "celsius", "gpu", "NVML or DCGM"),
    _m(
        GPU_PROCESS_MEMORY_USED_BYTES,
        "gauge",
        "GPU memory used per process (bounded: vLLM processes or the top N).",
        ("gpu", "uuid", "pid", "process"),
        "bytes",
        "gpu",
        "NVML running compute processes",
    ),
    _m(
        GPU_MEMORY_BUDGET_BYTES,
        "gauge",
        "GPU memory vLLM was told it may use.",
        GPU,
        "bytes",
        "memory",
        "vllm:cache_config_info{gpu_memory_utilization}, GPU total memory",
        "gpu_memory_utilization x total",
    ),
    _m(
        GPU_MEMORY_BUDGET_USAGE_RATIO,
        "gauge",
        "GPU memory used over the budget vLLM was given; above 1 means something else uses the GPU too.",
        GPU,
        "ratio",
        "memory",
        "GPU used memory, kvcache_gpu_memory_budget_bytes",
        "used / budget",
        allowed=(0.0, math.inf),  # above 1 is the finding, not an error
    ),
    _m(
        GPU_MEMORY_HEADROOM_RATIO,
        "gauge",
        "Share of GPU memory still free for co-located processes.",
        GPU,
        "ratio",
        "memory",
        "GPU used and total memory",
        "(total - used) / total",
    ),
    _m(
        GPU_MEMORY_SWING_BYTES,
        "gauge",
        "Largest minus smallest GPU memory in use over the window.",
        (*GPU, "window"),
        "bytes",
        "memory",
        "GPU used memory history",
        "max(used) - min(used) over the window",
    ),
    # --- config audit -----------------------------------------------------------------
    _m(
        CONFIG_CHECK,
        "gauge",
        "Result of a configuration check: 1 pass, 0 fail (the list: docs/gpu-cost.md, Config checks).",
        ("model_name", "check"),
        "",
        "config",
        "vllm:cache_config_info, observed concurrency and tokens, GPU memory, KV events, metric schema",
        per_target=False,  # one result per model, over every target
    ),
    # --- cost and energy --------------------------------------------------------------
    _m(
        COST_INFO,
        "gauge",
        "Pricing in force (value 1): the currency every cost metric uses.",
        ("currency",),
        "",
        "cost",
        "configuration",
        per_target=False,
    ),
    _m(
        GPU_COST_PER_HOUR,
        "gauge",
        "What the GPUs this exporter watches cost per hour.",
        (),
        "currency/h",
        "cost",
        "configured GPU-hour price (per GPU model), GPU count",
        "sum of price(GPU model) over GPUs",
        per_target=False,
    ),
    _m(
        COST_PER_MILLION_TOKENS,
        "gauge",
        "GPU cost over the window per million tokens; prompt vs generation split by prefill vs decode time.",
        ("token_kind", "window"),
        "currency/1e6 tokens",
        "cost",
        "GPU-hour price, vllm:prompt_tokens_total, vllm:generation_tokens_total, "
        "vllm:request_prefill_time_seconds_sum, vllm:request_decode_time_seconds_sum",
        "see docs/metrics.md#cost",
        per_target=False,
    ),
    _m(
        CACHE_SAVINGS_PER_HOUR,
        "gauge",
        "What the prefix cache saves per hour: cached prompt tokens priced as computed prompt tokens.",
        ("window",),
        "currency/h",
        "cost",
        "kvcache_prompt_tokens_total, kvcache_cost_per_million_tokens",
        "cached tokens/h x prompt cost per token",
        per_target=False,
    ),
    _m(
        CACHE_MISS_EXTRA_COST_PER_HOUR,
        "gauge",
        "Estimated extra cost per hour if the hit ratio fell to the configured floor.",
        ("window",),
        "currency/h",
        "cost",
        "kvcache_prompt_tokens_total, kvcache_cost_per_million_tokens, cost.hit_ratio_floor",
        "max(0, cached/h - floor x prompt/h) x prompt cost per token",
        per_target=False,
    ),
    _m(
        ENERGY_JOULES_PER_TOKEN,
        "gauge",
        "GPU energy per token (prompt + generation) over the window.",
        ("window",),
        "joules",
        "cost",
        "kvcache_gpu_energy_joules_total (power x time fallback), token counters",
        "increase(energy)/increase(tokens)",
        per_target=False,
    ),
    _m(
        ENERGY_COST_PER_MILLION_TOKENS,
        "gauge",
        "Energy cost per million tokens over the window (only when an energy price is set).",
        ("window",),
        "currency/1e6 tokens",
        "cost",
        "kvcache_energy_joules_per_token, cost.energy_price_per_kwh",
        "J/token x 1e6 / 3.6e6 x price per kWh",
        per_target=False,
    ),
    # --- KV events ----------------------------------------------------------------------
    _m(
        KV_EVENTS_BATCHES_TOTAL,
        "counter",
        "KV-event batches received from vLLM's ZMQ stream.",
        (),
        "",
        "events",
        "vLLM KV-event stream",
    ),
    _m(
        KV_EVENTS_TOTAL,
        "counter",
        "KV events received, by type (BlockStored, BlockRemoved, AllBlocksCleared).",
        ("type",),
        "",
        "events",
        "vLLM KV-event stream",
    ),
    _m(
        KV_EVENTS_MISSED_BATCHES_TOTAL,
        "counter",
        "Batches lost: gaps in the sequence numbers not filled by replay.",
        (),
        "",
        "events",
        "vLLM KV-event stream sequence numbers",
    ),
    _m(
        KV_EVENTS_PUBLISHER_RESTARTS_TOTAL,
        "counter",
        "Times the stream's sequence went back (or jumped absurdly far): a new publisher, usually a vLLM "
        "restart; the event view is reset and blocks held before read as `restart` misses.",
        (),
        "",
        "events",
        "vLLM KV-event stream sequence numbers",
    ),
    _m(
        KV_EVENTS_DROPPED_TOTAL,
        "counter",
        "Batches the exporter dropped itself: rate_limited (over --kv-events.max-batches-per-second), "
        "too_many_blocks (resident-hash bound), parse_error (undecodable), batch_too_heavy (one batch "
        "over the bytes, hashes or token-ids bound), budget_exceeded (over what one poll may queue or "
        "spend applying); and single events refused with the rest of their batch kept: invalid_event (a "
        "field outside its type or bounds), invalid_block_size (over 65,536, over the token ids the event "
        "carries, or its blocks over 1,048,576 tokens).",
        ("reason",),
        "",
        "events",
        "exporter limits",
    ),
    _m(
        KV_EVENTS_CACHED_BLOCKS,
        "gauge",
        "Blocks in vLLM's prefix-cache hash table according to the event stream (stored minus removed).",
        (),
        "blocks",
        "events",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    _m(
        KV_EVENTS_DISCOVERED_ENDPOINTS,
        "gauge",
        "KV-event publishers (one per data-parallel rank) found at the first vLLM's /kv_event_sources "
        "and subscribed to (only without --kv-events.endpoint).",
        (),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    _m(
        KV_EVENTS_DISCOVERY_STATE,
        "gauge",
        "1 for the state of KV-event discovery, 0 for the others: unknown (no answer yet), found, "
        "none_published (vLLM runs without --kv-events-config), no_route (a vLLM without "
        "/kv_event_sources: give --kv-events.endpoint).",
        ("state",),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    _m(
        KV_EVENTS_PUBLISHER_STATE,
        "gauge",
        "1 for the state of this rank's KV-event publisher, 0 for the others: connected (a vLLM "
        "publisher holds a connection), disconnected (one did, none does now), never_connected (none "
        "since the subscriber started: a rank past vLLM's data-parallel size, or a wrong endpoint).",
        ("state",),
        "",
        "events",
        "ZMQ socket monitor (accepted, connected, disconnected)",
    ),
    _m(
        KV_EVENTS_DISCOVERY_REJECTED,
        "gauge",
        "Entries of vLLM's current /kv_event_sources answer left out, by reason: not_tcp, bad_port, "
        "port_not_bound, bad_rank, rank_out_of_range, too_many_ranks, duplicate_rank, bad_entry, "
        "bad_field, replay_<reason> (only the replay endpoint left out).",
        ("reason",),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    _m(
        KV_EVENTS_DISCOVERY_CHANGES_TOTAL,
        "counter",
        "Times vLLM's answer changed (two answers in a row agreeing) and the subscribers were re-pointed: "
        "a vLLM restart on other ports.",
        (),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    # --- fleet view (`kvcache-exporter aggregate`) -----------------------------------------
    _m(
        FLEET_STORED_TOKENS_TOTAL,
        "counter",
        "Tokens in blocks the replica computed and stored (BlockStored), the denominator of the "
        "other_replica share.",
        ("replica",),
        "tokens",
        "fleet",
        "BlockStored events",
        "stored blocks x block_size / hash sampling",
    ),
    _m(
        FLEET_QUERY_TOKENS_TOTAL,
        "counter",
        "Prompt tokens looked up in the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_queries_total",
        "sum over engines",
    ),
    _m(
        FLEET_HIT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens served from the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_hits_total",
        "sum over engines",
    ),
    _m(
        FLEET_RESIDENT_BLOCKS,
        "gauge",
        "Blocks the replica holds according to its KV-event stream (tracked ones, scaled).",
        ("replica",),
        "blocks",
        "fleet",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    _m(
        FLEET_UNTRACKED_BLOCKS_TOTAL,
        "counter",
        "Stored blocks not tracked because the replica's bound (--replica.max-blocks) was full.",
        ("replica",),
        "blocks",
        "fleet",
        "aggregator bound",
    ),
    _m(
        FLEET_REPLICA_RESTARTS_TOTAL,
        "counter",
        "Times the replica's KV-event publisher started again (sequence back to 0): its blocks were "
        "dropped from the pool view.",
        ("replica",),
        "",
        "fleet",
        "KV-event sequence numbers",
    ),
    _m(
        FLEET_DISTINCT_BLOCKS,
        "gauge",
        "Distinct block hashes resident anywhere in the pool (scaled by 1/sampling).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    _m(
        FLEET_DUPLICATE_BLOCKS,
        "gauge",
        "Block hashes resident on two or more replicas at once: KV memory spent twice (scaled).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    _m(
        FLEET_DUPLICATE_BLOCKS_RATIO,
        "gauge",
        "Share of the pool's distinct resident blocks held by two or more replicas.",
        (),
        "ratio",
        "fleet",
        "every replica's KV events",
        "duplicate_blocks / distinct_blocks",
    ),
    _m(
        FLEET_HIT_RATIO,
        "gauge",
        "The pool's real prefix-cache hit ratio over the window.",
        ("window",),
        "ratio",
        "fleet",
        "vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total of every replica",
        "sum(hits) / sum(queries)",
    ),
    _m(
        FLEET_HIT_RATIO_ESTIMATE,
        "gauge",
        "The pool's hit ratio had every request gone to a replica holding its prefix (routing="
        "prefix_affinity), beside kvcache_fleet_hit_ratio.",
        ("window", "routing"),
        "ratio",
        "fleet",
        "/metrics and KV events of every replica",
        "min((sum(hits) + sum(other_replica miss tokens)) / sum(queries), 1); a shard scales its "
        "other_replica by its number of shards",
    ),
    _m(
        FLEET_SESSIONS,
        "gauge",
        "Sessions (BlockStored session_id) seen storing blocks in the pool lately: within one to two "
        "of the longest window, at most 65,536. Absent while no event carries a session id.",
        (),
        "",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
    ),
    _m(
        FLEET_SESSIONS_SPLIT,
        "gauge",
        "Of kvcache_fleet_sessions, those whose blocks were stored on two or more replicas: "
        "sessions the router split, from ground truth.",
        (),
        "",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
    ),
    _m(
        FLEET_SESSIONS_SPLIT_RATIO,
        "gauge",
        "Share of the pool's sessions whose blocks landed on two or more replicas (0 with sticky "
        "session routing), beside the prefix_affinity estimate.",
        (),
        "ratio",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
        "sessions_split / sessions",
    ),
    _m(
        FLEET_HASH_SAMPLING_RATIO,
        "gauge",
        "Fraction of the block-hash space the aggregator tracks (--fleet.hash-sampling); counts are "
        "scaled by its inverse.",
        (),
        "ratio",
        "fleet",
        "configuration",
    ),
    _m(
        FLEET_REPLICAS,
        "gauge",
        "Replicas the aggregator watches (from discovery, bounded by --replica.max).",
        (),
        "",
        "fleet",
        "discovery",
    ),
    _m(
        FLEET_REPLICAS_LEFT_OUT,
        "gauge",
        "Replicas discovery found beyond --replica.max, not watched.",
        (),
        "",
        "fleet",
        "discovery",
    ),
    # --- the fleet view on NATS JetStream (serve --fleet.publish, aggregate --fleet.source) -----
    _m(
        FLEET_PUBLISHED_TOTAL,
        "counter",
        "Messages (residency deltas, counters) the sidecar published to NATS JetStream and JetStream acked.",
        (),
        "messages",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_PUBLISH_DROPPED_TOTAL,
        "counter",
        "Messages the sidecar did not publish: buffer_full (NATS slower than the stream, or down, and the "
        "bounded buffer full), publish_error (no JetStream ack after 3 tries of 2 s, or an error another "
        "try cannot mend), not_connected. The shards "
        "count the lost deltas as kvcache_kv_events_missed_batches_total.",
        ("reason",),
        "messages",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_PUBLISH_BUFFERED,
        "gauge",
        "Messages waiting in the sidecar's bounded buffer for NATS.",
        (),
        "messages",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_PUBLISH_LAG_SECONDS,
        "gauge",
        "How long the oldest message in the sidecar's buffer has waited for NATS (0 when empty): "
        "publisher lag.",
        (),
        "seconds",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_PUBLISH_RESYNCS_TOTAL,
        "counter",
        "Times the sidecar's buffer overflowed (NATS down or slow) and the sidecar then resent the "
        "batches from vLLM's replay endpoint: done (the shards see no gap), failed (replay had no "
        "longer the batches, vLLM restarted meanwhile, no replay endpoint: the shards count the gap "
        "as kvcache_kv_events_missed_batches_total, as without replay).",
        ("result",),
        "resyncs",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_PUBLISH_RESYNCED_BLOCKS_TOTAL,
        "counter",
        "Block hashes (stored or removed) published from vLLM's replay after a buffer overflow.",
        (),
        "blocks",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_PUBLISH_RESYNC_PENDING,
        "gauge",
        "1 while the sidecar holds back its KV events after a buffer overflow, until NATS has taken "
        "the buffer and vLLM's replay resends them; else 0.",
        (),
        "",
        "fleet",
        "serve --fleet.publish",
    ),
    _m(
        FLEET_DELTAS_TOTAL,
        "counter",
        "Residency deltas and counters an aggregator shard read from NATS JetStream and applied.",
        (),
        "messages",
        "fleet",
        "aggregate --fleet.source",
    ),
    _m(
        FLEET_DELTAS_DROPPED_TOTAL,
        "counter",
        "Messages an aggregator shard read from NATS and dropped: parse_error, too_large, forged (pool, "
        "range or replica differs from the subject's), sampling_mismatch (published with another "
        "--fleet.hash-sampling), stale (an earlier epoch of the replica), duplicate (a redelivery or "
        "replay of a delta already applied), too_many_replicas (beyond --replica.max), unknown_engine "
        "(an engine other than vllm, sglang, trtllm), engine_changed (another engine within an epoch).",
        ("reason",),
        "messages",
        "fleet",
        "aggregate --fleet.source",
    ),
    _m(
        FLEET_CONSUMER_PENDING,
        "gauge",
        "Messages JetStream holds for the shard's durable consumer and has not delivered yet: consumer lag.",
        ("consumer",),
        "messages",
        "fleet",
        "JetStream consumer info (num_pending)",
    ),
    _m(
        FLEET_CONSUMER_REDELIVERED_TOTAL,
        "counter",
        "Messages JetStream delivered to the shard more than once (not acked in time, or a restart).",
        (),
        "messages",
        "fleet",
        "JetStream message metadata (num_delivered > 1)",
    ),
    # --- KV offloading (vLLM 0.33 /metrics, derive/offload.py) --------------------------------------
    _m(
        OFFLOAD_BYTES_PER_SECOND,
        "gauge",
        "KV offload transfer rate over the window: direction=load (offload tier -> GPU), store (GPU -> "
        "tier). Absent where vLLM exports no offload family.",
        ("model_name", "engine", "window", "direction"),
        "bytes_per_second",
        "cache",
        "vllm:kv_offload_{load,store}_bytes (else vllm:kv_offload_tiering_{read,write}_bytes)",
    ),
    _m(
        OFFLOAD_BUSY_RATIO,
        "gauge",
        "Share of the window vLLM spent transferring KV to (store) or from (load) the offload tier, summed "
        "over transfers (capped at 1).",
        ("model_name", "engine", "window", "direction"),
        "ratio",
        "cache",
        "vllm:kv_offload_{load,store}_time (else vllm:kv_offload_tiering_{read,write}_time)",
    ),
    _m(
        OFFLOAD_HOST_HIT_RATIO,
        "gauge",
        "Share of the window's prompt tokens served from the host (CPU) tier.",
        ("model_name", "engine", "window"),
        "ratio",
        "cache",
        'vllm:prompt_tokens_cached_by_source_total{source="host"}, vllm:prefix_cache_queries_total',
    ),
    _m(
        OFFLOAD_STORES_WITHOUT_LOADS,
        "gauge",
        "1 when the window stored KV to the offload tier and loaded none back: a tier that costs transfer "
        "time and memory and earns nothing; else 0.",
        ("model_name", "engine", "window"),
        "",
        "cache",
        "vllm:kv_offload_store_bytes, vllm:kv_offload_load_bytes",
        allowed=(0.0, 1.0),
    ),
    _m(
        OFFLOAD_ALLOCATION_FAILURES_TOTAL,
        "counter",
        "KV offload store allocation attempts that failed (the tier was full).",
        ("model_name", "engine"),
        "",
        "cache",
        "vllm:kv_offload_allocation_failure",
    ),
    _m(
        OFFLOAD_STORES_SKIPPED_TOTAL,
        "counter",
        "KV offload stores the CPU tier skipped.",
        ("model_name", "engine"),
        "",
        "cache",
        "vllm:kv_offload_stores_skipped",
    ),
    # --- KV-event groups and hit units (derive/units.py) ------------------------------------------
    _m(
        KV_EVENTS_GROUP_INFO,
        "gauge",
        "One series per KV-cache group the event stream announced (vLLM's hybrid KV cache): its kind, "
        "sliding window and block sizes (comma-joined when one group uses several). Value 1.",
        ("group", "kind", "sliding_window", "block_size"),
        "",
        "attribution",
        "BlockStored group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, block_size",
    ),
    _m(
        KV_EVENTS_HIT_UNIT_TOKENS,
        "gauge",
        "Tokens per hit unit: the granularity of vLLM's prefix hits (the full-attention group's block; "
        "256 on DeepSeek-V4 whatever block_size says). Absent before the first store.",
        (),
        "tokens",
        "attribution",
        "BlockStored of the first full-attention group",
    ),
    _m(
        KV_EVENTS_STORED_TOKENS_TOTAL,
        "counter",
        "Tokens vLLM stored on the GPU (computed: prompt units, their below-unit remainder, decode "
        "blocks), each hit unit once whatever the number of groups, by LoRA adapter (`base` without; "
        "the first 10 adapters seen keep their own series, later ones add to `other`).",
        ("adapter",),
        "tokens",
        "attribution",
        "BlockStored lora_name, token_ids",
    ),
    _m(
        KV_EVENTS_REUSED_TOKENS_TOTAL,
        "counter",
        "Prefix-cache hits re-announced by requests with kv_cache_report_mode=full (a BlockStored "
        "without parent whose blocks were all still held): hits, never misses. By adapter as above.",
        ("adapter",),
        "tokens",
        "attribution",
        "BlockStored (parent_block_hash null, hashes resident)",
        "per-adapter hit ratio: reused / (reused + stored)",
    ),
    _m(
        KV_EVENTS_SESSION_TOKENS_TOTAL,
        "counter",
        "Stored (kind=stored) and re-announced (kind=reused) tokens by session id, for the first 10 "
        "sessions seen (later ones add to session=`other`).",
        ("session", "kind"),
        "tokens",
        "attribution",
        "BlockStored session_id",
        "per-session hit ratio: reused / (reused + stored)",
    ),
    _m(
        KV_EVENTS_SESSION_ID_RATIO,
        "gauge",
        "Share of stored tokens whose request carried a session id (request field, X-Session-ID "
        "header or vllm_xargs): is the session id passed end to end? Since start.",
        (),
        "ratio",
        "attribution",
        "BlockStored session_id",
    ),
    _m(
        KV_EVENTS_WINDOW_EVICTIONS_TOTAL,
        "counter",
        "Hit units made unhittable by the removal of a sliding-window or state block while the "
        "full-attention group still held the unit (vLLM's hybrid hit rule needs every group's part).",
        (),
        "",
        "attribution",
        "BlockRemoved of windowed groups",
    ),
    _m(
        KV_EVENTS_TIER_BLOCKS,
        "gauge",
        "Blocks an offload tier holds according to the event stream (events whose medium is not GPU: "
        "CPU, STORAGE...), by medium.",
        ("medium",),
        "blocks",
        "attribution",
        "BlockStored/BlockRemoved medium",
    ),
    _m(
        KV_EVENTS_TIER_BYTES,
        "gauge",
        "kvcache_kv_events_tier_blocks x the bytes of one GPU block (cache_config_info "
        "kv_cache_memory_bytes / num_gpu_blocks), by medium. Absent while that is unknown.",
        ("medium",),
        "bytes",
        "attribution",
        "BlockStored/BlockRemoved medium; vllm:cache_config_info",
    ),
    _m(
        KV_EVENTS_TIER_HIT_TOKENS_TOTAL,
        "counter",
        "Tokens stored on the GPU whose blocks an offload tier held: loads back from that tier (tier "
        "hits), never computed misses. By medium.",
        ("medium",),
        "tokens",
        "attribution",
        "BlockStored medium",
    ),
    # --- miss attribution (KV events) ---------------------------------------------------------
    _m(
        PREFIX_CACHE_MISS_TOKENS_TOTAL,
        "counter",
        "Prompt tokens vLLM computed (stored blocks x block size), by why they were not cached "
        "(docs/kv-events.md, a section per cause): evicted (cache too small), window_expired (a sliding-"
        "window part dropped: --prefix-cache-retention-interval), restart, other_replica, history_rewritten "
        "(the chat template re-renders an earlier turn unlike the model wrote it), prefix_diverged (per-"
        "request content before shared content), content_moved (known sections in another order), "
        "below_hit_unit (shared content shorter than the hit unit), identity_isolated (held under another "
        "LoRA adapter or cache_salt: by design, not a fault), cold (new content). Loads back from an "
        "offload tier are not misses: kvcache_kv_events_tier_hit_tokens_total. The sidecar never sets "
        "other_replica; `kvcache-exporter aggregate` exports cause=other_replica with a `replica` label.",
        ("cause",),
        "tokens",
        "attribution",
        "BlockStored (hashes, parent, token_ids), BlockRemoved, AllBlocksCleared, seq",
        "each stored block classified in stream order; decode-filled blocks excluded",
    ),
    _m(
        PREFIX_CACHE_REORDER_HIT_TOKENS_TOTAL,
        "counter",
        "Of the prefix_diverged miss tokens, those a reorder would have served, per layout: end (the "
        "per-request fields after everything the requests share) or after_template (right after the shared "
        "template, before what follows it such as the question); docs/kv-events.md.",
        ("layout",),
        "tokens",
        "attribution",
        "BlockStored token_ids (anchor fingerprints and the order they came in)",
        "prefix_diverged tokens reached in an earlier order; after_template: up to a branch point",
    ),
    _m(
        KV_EVENTS_DECODE_TOKENS_TOTAL,
        "counter",
        "Tokens of blocks filled during decode (one block extending a request's still-open last block); "
        "not prompt misses.",
        (),
        "tokens",
        "attribution",
        "BlockStored",
    ),
    _m(
        PREFIX_DIVERGENCE_OFFSET_TOKENS,
        "histogram",
        "Where the shared content starts in prompts whose prefix diverged: tokens of per-request front "
        "matter before content the cache already holds. One observation per diverged chain.",
        (),
        "tokens",
        "attribution",
        "BlockStored token_ids, parent_block_hash",
        "chain depth x block size + where the first known content fingerprint starts",
    ),
    _m(
        PREFIX_DIVERGED_FIELD_TOKENS_TOTAL,
        "counter",
        "prefix_diverged miss tokens of the sampled diverged prompts (at most --fields.max-per-second "
        "a second), by the field in front of the known content: the first dynamic field of the decoded "
        "front (timestamp, date, time, uuid, email, url, hex, id, number, template, a --fields.pattern "
        "name, or other). Only with --fields.tokenizer; a share, not a total (docs/kv-events.md).",
        ("field",),
        "tokens",
        "attribution",
        "BlockStored token_ids (decoded with the model's tokenizer)",
        "the front's first tokens decoded and classified by rules (derive/fields.py)",
    ),
    _m(
        PREFIX_HISTORY_REWRITTEN_TURN,
        "histogram",
        "Which rewritten turn of a conversation a history_rewritten miss is: 1 for the first turn whose "
        "earlier answer the chat template re-rendered differently, 2 for the next along the same chain "
        "(the assistant turn where it diverges when every turn is rewritten; counted up to 7). One "
        "observation per history_rewritten stored run.",
        (),
        "",
        "attribution",
        "BlockStored token_ids, parent_block_hash (decode-filled blocks' content)",
        "1 + the history_rewritten runs along the chain before it",
    ),
    _m(
        PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED,
        "gauge",
        "Entries the attribution memory holds: kind=blocks (stored hashes, --kv-events.max-tracked-blocks), "
        "kind=fingerprints (content fingerprints, --kv-events.max-fingerprints). It grows with new content "
        "up to the limit, then forgets its older half.",
        ("kind",),
        "",
        "attribution",
        "BlockStored, BlockRemoved",
    ),
    _m(
        PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED_LIMIT,
        "gauge",
        "The configured bound of kvcache_prefix_cache_miss_attribution_tracked, by kind.",
        ("kind",),
        "",
        "attribution",
        "flags",
    ),
    _m(
        PREFIX_CACHE_MISS_ATTRIBUTION_COVERAGE_RATIO,
        "gauge",
        "Share of the prompt tokens vLLM computed in the window that the KV-event stream attributed to a "
        "cause; low when batches were lost, dropped, or events are off. Absent without computed tokens, "
        "and while more tokens were attributed than computed (kvcache_prefix_cache_miss_attribution_excess_"
        "tokens above 0), as are the window's hit-ratio estimates.",
        ("window",),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total; vllm:prefix_cache_queries_total - "
        "vllm:prefix_cache_hits_total",
        "increase(attributed) / (increase(queries) - increase(hits)); each prompt's last partial "
        "block is never stored, so it sits below 1 by up to block_size - 1 tokens per request",
    ),
    _m(
        PREFIX_CACHE_MISS_ATTRIBUTION_EXCESS_TOKENS,
        "gauge",
        "Prompt tokens the KV-event stream attributed over the window beyond what vLLM computed: a fault "
        "(a broken or hostile publisher, or events running ahead of /metrics), 0 when healthy. While above "
        "0, coverage and the hit-ratio estimates of the window are absent, never clipped to 1.",
        ("window",),
        "tokens",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total; vllm:prefix_cache_queries_total - "
        "vllm:prefix_cache_hits_total",
        "max(increase(attributed) - (increase(queries) - increase(hits)), 0)",
    ),
    _m(
        PREFIX_CACHE_HIT_RATIO_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window had the KV cache been capacity_factor (2, 4) times "
        "larger, from blocks evicted and recomputed soon enough that the larger cache would have kept them.",
        ("window", "capacity_factor"),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=evicted}; vllm:prefix_cache_{hits,queries}_total; "
        "num_gpu_blocks",
        "(increase(hits) + increase(evicted tokens recomputed within (f-1) x num_gpu_blocks stored blocks)) "
        "/ increase(queries); docs/kv-events.md gives the bias",
    ),
    _m(
        PREFIX_CACHE_HIT_RATIO_REORDERED_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window had the per-request fields come after the shared "
        "part: the prefix_diverged tokens (whole hit units of known content behind a per-request front) "
        "would have hit. Equal to the real ratio when nothing diverged.",
        ("window",),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=prefix_diverged}; "
        "vllm:prefix_cache_{hits,queries}_total",
        "(increase(hits) + increase(prefix_diverged tokens)) / increase(queries); docs/kv-events.md",
    ),
    _m(
        PREFIX_CACHE_HIT_RATIO_REORDERED_LAYOUT_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window had the per-request fields been moved, per layout: "
        "layout=end (after everything the requests share) or after_template (right after the shared "
        "template, before what follows it such as the question). Of the prefix_diverged tokens, those "
        "reached in the order earlier requests had them (and, after_template, before the first point "
        "where requests sharing the template went their own ways) would have hit.",
        ("window", "layout"),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=prefix_diverged}; "
        "vllm:prefix_cache_{hits,queries}_total",
        "(increase(hits) + increase(reorder tokens of the layout)) / increase(queries); docs/kv-events.md",
    ),
    _m(
        PREFIX_CACHE_HIT_RATIO_HOST_TIER_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window with a host (CPU) tier added: "
        "--whatif.host-tier-bytes, else the tier vLLM reports (num_cpu_blocks, kv_offloading_size). Blocks "
        "evicted and recomputed within the tier's size in stored blocks would have been loaded from it. "
        "Absent while no tier size is known.",
        ("window",),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=evicted}; vllm:prefix_cache_{hits,queries}_total; "
        "cache_config_info kv_cache_memory_bytes, kv_cache_size_tokens, block_size",
        "(increase(hits) + increase(evicted tokens recomputed within host_bytes / (bytes per token x block "
        "size) stored blocks)) / increase(queries)",
    ),
    _m(
        HOST_TIER_LOAD_BYTES_PER_SECOND_ESTIMATE,
        "gauge",
        "KV bytes per second the host tier of kvcache_prefix_cache_hit_ratio_host_tier_estimate would load "
        "back into the GPU over the window (its extra hits x KV bytes per token): the transfer it adds.",
        ("window",),
        "bytes/s",
        "attribution",
        "cache_config_info kv_cache_memory_bytes, kv_cache_size_tokens",
        "increase(host-tier hit tokens) x kv_cache_memory_bytes / kv_cache_size_tokens / window seconds",
    ),
    # --- vLLM schema and exporter health ------------------------------------------------
    _m(
        VLLM_UP,
        "gauge",
        "1 when the last poll of vLLM's /metrics succeeded.",
        (),
        "",
        "health",
        "HTTP poll",
    ),
    _m(
        VLLM_SCHEMA_INFO,
        "gauge",
        "Which vLLM metric naming generation the target exposes (value 1).",
        ("schema", "prefix"),
        "",
        "health",
        "metric names on the scrape",
        "v1 (current names), v1-deprecated (gpu_prefix_cache_*, gpu_cache_usage_perc), v0",
    ),
    _m(
        VLLM_DEPRECATED_METRICS,
        "gauge",
        "Deprecated vLLM metric names the target still exposes and the exporter reads.",
        (),
        "",
        "health",
        "metric names on the scrape",
    ),
    _m(
        VLLM_MISSING_METRICS,
        "gauge",
        "Expected vLLM metrics missing from the scrape (a rename would otherwise zero a dashboard).",
        (),
        "",
        "health",
        "metric names on the scrape",
    ),
    _m(
        EXPORTER_COLLECTOR_SUCCESS,
        "gauge",
        "1 when the collector's last run succeeded.",
        ("collector",),
        "",
        "health",
    ),
    _m(
        EXPORTER_COLLECTOR_DURATION_SECONDS,
        "gauge",
        "How long the collector's last run took.",
        ("collector",),
        "seconds",
        "health",
    ),
    _m(
        EXPORTER_LAST_SUCCESS_TIMESTAMP_SECONDS,
        "gauge",
        "Unix time of the collector's last successful run.",
        ("collector",),
        "seconds",
        "health",
    ),
    _m(
        EXPORTER_ERRORS_TOTAL,
        "counter",
        "Collector errors by reason (timeout, connection, http_status, parse_error, body_too_large, "
        "too_many_series, fd_exhausted: the exporter's own open-file limit, not the target, ...).",
        ("collector", "reason"),
        "",
        "health",
    ),
    _m(
        EXPORTER_HTTP_REJECTED_TOTAL,
        "counter",
        "Connections and requests our endpoint refused, by reason: too_many_connections (every slot "
        "has a request in flight), idle_evicted (an idle connection closed to let a new one in), "
        "tls_handshake (failed or timed out), header_too_large, bad_request, auth_busy (too many "
        "checks of unknown passwords queued).",
        ("reason",),
        "",
        "health",
        per_target=False,
    ),
    _m(
        EXPORTER_BUILD_INFO,
        "gauge",
        "Exporter version (value 1).",
        ("version", "python_version"),
        "",
        "health",
        per_target=False,
    ),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOG}


def constant_name(metric_name: str) -> str:
    """kvcache_prefix_cache_hit_ratio -> PREFIX_CACHE_HIT_RATIO, the constant call sites use."""
    return metric_name.removeprefix("kvcache_").upper()


def _check_constants() -> None:
    """Every family has its constant and every constant its family: a new one needs both."""
    constants = {
        v for k, v in globals().items() if k.isupper() and isinstance(v, str) and v.startswith("kvcache_")
    }
    assert constants == set(BY_NAME), sorted(constants ^ set(BY_NAME))
    assert all(globals().get(constant_name(name)) == name for name in BY_NAME)
    assert len(BY_NAME) == len(CATALOG), "a family is declared twice"


_check_constants()


def get(name: str) -> Metric:
    return BY_NAME[name]


def add(metrics: tuple[Metric, ...]) -> None:
    """A source's own entries (kit.register): the catalog is the built-ins, then each row's."""
    global CATALOG
    taken = [m.name for m in metrics if m.name in BY_NAME]
    if taken or len({m.name for m in metrics}) != len(metrics):
        raise ValueError(f"metric declared twice: {', '.join(taken) or 'within one source'}")
    CATALOG = CATALOG + tuple(metrics)
    BY_NAME.update((m.name, m) for m in metrics)
