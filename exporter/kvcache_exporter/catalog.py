"""Every metric the exporter serves, declared once.

docs/metrics.md is generated from this table (`kvcache-exporter docs`); alerts and
dashboards are tested against it. Label sets are the base labels: with more than one
vLLM target every vLLM-derived series also carries `target`.
"""

from __future__ import annotations

from dataclasses import dataclass

ME = ("model_name", "engine")
GPU = ("gpu", "uuid", "name")


@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # counter | gauge | summary (windowed quantiles: promtool wants `quantile` only on summaries)
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    group: str = "cache"
    source: str = ""  # the vLLM/GPU inputs
    formula: str = ""
    per_target: bool = True  # gets a `target` label when several vLLM targets are polled


_NOT_PER_TARGET = {"gpu", "memory", "cost", "events", "fleet"}


def _m(*args, **kwargs) -> Metric:
    metric = Metric(*args, **kwargs)
    if metric.group in _NOT_PER_TARGET and "per_target" not in kwargs:
        metric = Metric(*args, **{**kwargs, "per_target": False})
    return metric


CATALOG: tuple[Metric, ...] = (
    # --- prefix cache ---------------------------------------------------------------
    _m(
        "kvcache_prefix_cache_query_tokens_total",
        "counter",
        "Prompt tokens looked up in vLLM's prefix cache, normalized across vLLM versions.",
        ME,
        "tokens",
        source="vllm:prefix_cache_queries_total; vllm:gpu_prefix_cache_queries_total (blocks x block_size "
        "when its HELP says blocks)",
        formula="copied (reset-safe: it resets when vLLM restarts, like vLLM's own counter)",
    ),
    _m(
        "kvcache_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from vLLM's prefix cache, normalized across vLLM versions.",
        ME,
        "tokens",
        source="vllm:prefix_cache_hits_total; vllm:gpu_prefix_cache_hits_total",
        formula="copied",
    ),
    _m(
        "kvcache_prefix_cache_hit_ratio",
        "gauge",
        "Share of queried prompt tokens that hit the prefix cache over the window; absent when the window "
        "saw no queries.",
        (*ME, "window"),
        "ratio",
        source="vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total",
        formula="increase(hits)/increase(queries) over the window, counter resets handled like rate()",
    ),
    _m(
        "kvcache_vllm_v0_prefix_cache_block_hit_ratio",
        "gauge",
        "V0 engines only: vLLM's own lifetime block hit-rate gauge (no token counters exist in V0).",
        ME,
        "ratio",
        source="vllm:gpu_prefix_cache_hit_rate",
        formula="copied; the -1 that V0 reports when prefix caching is off is dropped",
    ),
    _m(
        "kvcache_prompt_tokens_total",
        "counter",
        "Prompt tokens by where their KV came from: computed (prefill work) or cached (prefix-cache hit).",
        (*ME, "source"),
        "tokens",
        source="vllm:prompt_tokens_by_source_total, else vllm:prompt_tokens_total - prefix cache hits",
        formula="computed = local_compute; cached = local_cache_hit + external_kv_transfer",
    ),
    _m(
        "kvcache_prompt_tokens_per_second",
        "gauge",
        "Prompt tokens per second over the window, computed vs cached.",
        (*ME, "source", "window"),
        "tokens/s",
        source="kvcache_prompt_tokens_total",
        formula="increase/window duration",
    ),
    _m(
        "kvcache_generation_tokens_total",
        "counter",
        "Generated (decode) tokens.",
        ME,
        "tokens",
        source="vllm:generation_tokens_total",
        formula="copied",
    ),
    _m(
        "kvcache_generation_tokens_per_second",
        "gauge",
        "Generated tokens per second over the window.",
        (*ME, "window"),
        "tokens/s",
        source="vllm:generation_tokens_total",
        formula="increase/window duration",
    ),
    _m(
        "kvcache_preemptions_total",
        "counter",
        "Requests preempted because KV blocks ran out.",
        ME,
        source="vllm:num_preemptions_total",
        formula="copied",
    ),
    _m(
        "kvcache_preemptions_per_second",
        "gauge",
        "Preemptions per second over the window.",
        (*ME, "window"),
        "1/s",
        source="vllm:num_preemptions_total",
        formula="increase/window duration",
    ),
    # --- blocks ---------------------------------------------------------------------
    _m(
        "kvcache_block_utilization_ratio",
        "gauge",
        "Share of KV blocks referenced by running requests (evictable cached blocks count as free).",
        ME,
        "ratio",
        source="vllm:kv_cache_usage_perc (0-1); vllm:gpu_cache_usage_perc",
        formula="copied, clamped to 0-1",
        group="blocks",
    ),
    _m(
        "kvcache_blocks_capacity",
        "gauge",
        "KV blocks vLLM allocated for this engine.",
        ME,
        "blocks",
        source="vllm:cache_config_info{num_gpu_blocks}",
        formula="num_gpu_blocks",
        group="blocks",
    ),
    _m(
        "kvcache_blocks_in_use",
        "gauge",
        "KV blocks referenced by running requests.",
        ME,
        "blocks",
        source="vllm:kv_cache_usage_perc, vllm:cache_config_info{num_gpu_blocks}",
        formula="utilization x (num_gpu_blocks - 1), the null block excluded as vLLM does",
        group="blocks",
    ),
    _m(
        "kvcache_block_size_tokens",
        "gauge",
        "Tokens per KV block.",
        ME,
        "tokens",
        source="vllm:cache_config_info{block_size}",
        formula="block_size",
        group="blocks",
    ),
    _m(
        "kvcache_capacity_tokens",
        "gauge",
        "Tokens the KV cache can hold.",
        ME,
        "tokens",
        source="vllm:cache_config_info{kv_cache_size_tokens}, else num_gpu_blocks x block_size",
        formula="kv_cache_size_tokens or num_gpu_blocks x block_size",
        group="blocks",
    ),
    _m(
        "kvcache_block_fragmentation_estimate_ratio",
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
        "kvcache_requests_running",
        "gauge",
        "Requests in the model's running batch.",
        ME,
        source="vllm:num_requests_running",
        formula="copied",
        group="blocks",
    ),
    _m(
        "kvcache_requests_waiting",
        "gauge",
        "Requests waiting to be scheduled.",
        ME,
        source="vllm:num_requests_waiting",
        formula="copied",
        group="blocks",
    ),
    _m(
        "kvcache_vllm_config_info",
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
            ("kvcache_prefill_latency_seconds", "Prefill time", "vllm:request_prefill_time_seconds"),
            (
                "kvcache_time_to_first_token_seconds",
                "Time to first token",
                "vllm:time_to_first_token_seconds",
            ),
            ("kvcache_queue_time_seconds", "Queue time", "vllm:request_queue_time_seconds"),
            ("kvcache_e2e_latency_seconds", "End-to-end request latency", "vllm:e2e_request_latency_seconds"),
        )
    ),
    # --- GPU --------------------------------------------------------------------------
    _m("kvcache_gpu_memory_used_bytes", "gauge", "GPU memory in use.", GPU, "bytes", "gpu", "NVML or DCGM"),
    _m(
        "kvcache_gpu_memory_total_bytes", "gauge", "GPU memory in total.", GPU, "bytes", "gpu", "NVML or DCGM"
    ),
    _m(
        "kvcache_gpu_utilization_ratio",
        "gauge",
        "GPU (SM) utilization, 0-1.",
        GPU,
        "ratio",
        "gpu",
        "NVML or DCGM",
    ),
    _m(
        "kvcache_gpu_memory_bandwidth_utilization_ratio",
        "gauge",
        "Memory-controller utilization, 0-1.",
        GPU,
        "ratio",
        "gpu",
        "NVML or DCGM",
    ),
    _m("kvcache_gpu_power_watts", "gauge", "Power draw.", GPU, "watts", "gpu", "NVML or DCGM"),
    _m(
        "kvcache_gpu_energy_joules_total",
        "counter",
        "Energy consumed since the driver loaded.",
        GPU,
        "joules",
        "gpu",
        "NVML total energy (mJ) or DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)",
        "mJ / 1000",
    ),
    _m("kvcache_gpu_temperature_celsius", "gauge", "GPU temperature.", GPU, "celsius", "gpu", "NVML or DCGM"),
    _m(
        "kvcache_gpu_process_memory_used_bytes",
        "gauge",
        "GPU memory used per process (bounded: vLLM processes or the top N).",
        ("gpu", "uuid", "pid", "process"),
        "bytes",
        "gpu",
        "NVML running compute processes",
    ),
    _m(
        "kvcache_gpu_memory_budget_bytes",
        "gauge",
        "GPU memory vLLM was told it may use.",
        GPU,
        "bytes",
        "memory",
        "vllm:cache_config_info{gpu_memory_utilization}, GPU total memory",
        "gpu_memory_utilization x total",
    ),
    _m(
        "kvcache_gpu_memory_budget_usage_ratio",
        "gauge",
        "GPU memory used over the budget vLLM was given; above 1 means something else uses the GPU too.",
        GPU,
        "ratio",
        "memory",
        "GPU used memory, kvcache_gpu_memory_budget_bytes",
        "used / budget",
    ),
    _m(
        "kvcache_gpu_memory_headroom_ratio",
        "gauge",
        "Share of GPU memory still free for co-located processes.",
        GPU,
        "ratio",
        "memory",
        "GPU used and total memory",
        "(total - used) / total",
    ),
    _m(
        "kvcache_gpu_memory_swing_bytes",
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
        "kvcache_config_check",
        "gauge",
        "Result of a configuration check: 1 pass, 0 fail (see docs/metrics.md for the list).",
        ("model_name", "check"),
        "",
        "config",
        "vllm:cache_config_info, observed concurrency, metric schema",
    ),
    # --- cost and energy --------------------------------------------------------------
    _m(
        "kvcache_cost_info",
        "gauge",
        "Pricing in force (value 1): the currency every cost metric uses.",
        ("currency",),
        "",
        "cost",
        "configuration",
        per_target=False,
    ),
    _m(
        "kvcache_gpu_cost_per_hour",
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
        "kvcache_cost_per_million_tokens",
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
        "kvcache_cache_savings_per_hour",
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
        "kvcache_cache_miss_extra_cost_per_hour",
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
        "kvcache_energy_joules_per_token",
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
        "kvcache_energy_cost_per_million_tokens",
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
        "kvcache_kv_events_batches_total",
        "counter",
        "KV-event batches received from vLLM's ZMQ stream.",
        (),
        "",
        "events",
        "vLLM KV-event stream",
    ),
    _m(
        "kvcache_kv_events_total",
        "counter",
        "KV events received, by type (BlockStored, BlockRemoved, AllBlocksCleared).",
        ("type",),
        "",
        "events",
        "vLLM KV-event stream",
    ),
    _m(
        "kvcache_kv_events_missed_batches_total",
        "counter",
        "Batches lost: gaps in the sequence numbers not filled by replay.",
        (),
        "",
        "events",
        "vLLM KV-event stream sequence numbers",
    ),
    _m(
        "kvcache_kv_events_dropped_total",
        "counter",
        "Batches the exporter dropped itself: rate_limited (over --kv-events.max-batches-per-second), "
        "too_many_blocks (resident-hash bound), parse_error (undecodable).",
        ("reason",),
        "",
        "events",
        "exporter limits",
    ),
    _m(
        "kvcache_kv_events_cached_blocks",
        "gauge",
        "Blocks in vLLM's prefix-cache hash table according to the event stream (stored minus removed).",
        (),
        "blocks",
        "events",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    # --- fleet view (`kvcache-exporter aggregate`) -----------------------------------------
    _m(
        "kvcache_prefix_cache_miss_tokens_total",
        "counter",
        "Prompt tokens vLLM had to compute, by why they were not in its prefix cache. The aggregator "
        "exports cause=other_replica per replica: blocks computed while another replica of the pool "
        "held the same hash.",
        ("replica", "cause"),
        "tokens",
        "fleet",
        "BlockStored events of every replica; block_size from cache_config_info",
        "other_replica blocks x block_size / hash sampling",
    ),
    _m(
        "kvcache_fleet_stored_tokens_total",
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
        "kvcache_fleet_query_tokens_total",
        "counter",
        "Prompt tokens looked up in the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_queries_total",
        "sum over engines",
    ),
    _m(
        "kvcache_fleet_hit_tokens_total",
        "counter",
        "Prompt tokens served from the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_hits_total",
        "sum over engines",
    ),
    _m(
        "kvcache_fleet_resident_blocks",
        "gauge",
        "Blocks the replica holds according to its KV-event stream (tracked ones, scaled).",
        ("replica",),
        "blocks",
        "fleet",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    _m(
        "kvcache_fleet_untracked_blocks_total",
        "counter",
        "Stored blocks not tracked because the replica's bound (--replica.max-blocks) was full.",
        ("replica",),
        "blocks",
        "fleet",
        "aggregator bound",
    ),
    _m(
        "kvcache_fleet_replica_restarts_total",
        "counter",
        "Times the replica's KV-event publisher started again (sequence back to 0): its blocks were "
        "dropped from the pool view.",
        ("replica",),
        "",
        "fleet",
        "KV-event sequence numbers",
    ),
    _m(
        "kvcache_fleet_distinct_blocks",
        "gauge",
        "Distinct block hashes resident anywhere in the pool (scaled by 1/sampling).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    _m(
        "kvcache_fleet_duplicate_blocks",
        "gauge",
        "Block hashes resident on two or more replicas at once: KV memory spent twice (scaled).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    _m(
        "kvcache_fleet_duplicate_blocks_ratio",
        "gauge",
        "Share of the pool's distinct resident blocks held by two or more replicas.",
        (),
        "",
        "fleet",
        "every replica's KV events",
        "duplicate_blocks / distinct_blocks",
    ),
    _m(
        "kvcache_fleet_hit_ratio",
        "gauge",
        "The pool's real prefix-cache hit ratio over the window.",
        ("window",),
        "",
        "fleet",
        "vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total of every replica",
        "sum(hits) / sum(queries)",
    ),
    _m(
        "kvcache_fleet_hit_ratio_estimate",
        "gauge",
        "The pool's hit ratio had every request gone to a replica holding its prefix (routing="
        "prefix_affinity), beside kvcache_fleet_hit_ratio.",
        ("window", "routing"),
        "",
        "fleet",
        "/metrics and KV events of every replica",
        "min((sum(hits) + sum(other_replica miss tokens)) / sum(queries), 1); a shard scales its "
        "other_replica by its number of shards",
    ),
    _m(
        "kvcache_fleet_hash_sampling_ratio",
        "gauge",
        "Fraction of the block-hash space the aggregator tracks (--fleet.hash-sampling); counts are "
        "scaled by its inverse.",
        (),
        "",
        "fleet",
        "configuration",
    ),
    _m(
        "kvcache_fleet_replicas",
        "gauge",
        "Replicas the aggregator watches (from discovery, bounded by --replica.max).",
        (),
        "",
        "fleet",
        "discovery",
    ),
    _m(
        "kvcache_fleet_replicas_left_out",
        "gauge",
        "Replicas discovery found beyond --replica.max, not watched.",
        (),
        "",
        "fleet",
        "discovery",
    ),
    # --- vLLM schema and exporter health ------------------------------------------------
    _m(
        "kvcache_vllm_up",
        "gauge",
        "1 when the last poll of vLLM's /metrics succeeded.",
        (),
        "",
        "health",
        "HTTP poll",
    ),
    _m(
        "kvcache_vllm_schema_info",
        "gauge",
        "Which vLLM metric naming generation the target exposes (value 1).",
        ("schema", "prefix"),
        "",
        "health",
        "metric names on the scrape",
        "v1 (current names), v1-deprecated (gpu_prefix_cache_*, gpu_cache_usage_perc), v0",
    ),
    _m(
        "kvcache_vllm_deprecated_metrics",
        "gauge",
        "Deprecated vLLM metric names the target still exposes and the exporter reads.",
        (),
        "",
        "health",
        "metric names on the scrape",
    ),
    _m(
        "kvcache_vllm_missing_metrics",
        "gauge",
        "Expected vLLM metrics missing from the scrape (a rename would otherwise zero a dashboard).",
        (),
        "",
        "health",
        "metric names on the scrape",
    ),
    _m(
        "kvcache_exporter_collector_success",
        "gauge",
        "1 when the collector's last run succeeded.",
        ("collector",),
        "",
        "health",
    ),
    _m(
        "kvcache_exporter_collector_duration_seconds",
        "gauge",
        "How long the collector's last run took.",
        ("collector",),
        "seconds",
        "health",
    ),
    _m(
        "kvcache_exporter_last_success_timestamp_seconds",
        "gauge",
        "Unix time of the collector's last successful run.",
        ("collector",),
        "seconds",
        "health",
    ),
    _m(
        "kvcache_exporter_errors_total",
        "counter",
        "Collector errors by reason (timeout, connection, http_status, parse_error, body_too_large, "
        "too_many_series, ...).",
        ("collector", "reason"),
        "",
        "health",
    ),
    _m(
        "kvcache_exporter_build_info",
        "gauge",
        "Exporter version (value 1).",
        ("version", "python_version"),
        "",
        "health",
        per_target=False,
    ),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOG}


def get(name: str) -> Metric:
    return BY_NAME[name]
