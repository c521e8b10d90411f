"""Every metric the exporter serves, declared once: the entries below and, concatenated in their
place, those each source declares beside its code (DECLARED: sources/*_kit.py).

docs/metrics.md is generated from this table (`kvcache-exporter docs`); alerts and
dashboards are tested against it. Label sets are the base labels: with more than one
vLLM target every vLLM-derived series also carries `target`.
"""

from __future__ import annotations

from . import fleet_publish_kit
from .derive import audit_kit, cost_kit
from .metric import ME, Metric
from .metric import entry as _m
from .sources import gpu_kit, kv_events_kit

DECLARED = (
    gpu_kit,
    audit_kit,
    cost_kit,
    kv_events_kit,
    fleet_publish_kit,
)  # the modules declaring a source's entries

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
OFFLOAD_BYTES_PER_SECOND = "kvcache_offload_bytes_per_second"
OFFLOAD_BUSY_RATIO = "kvcache_offload_busy_ratio"
OFFLOAD_HOST_HIT_RATIO = "kvcache_offload_host_hit_ratio"
OFFLOAD_STORES_WITHOUT_LOADS = "kvcache_offload_stores_without_loads"
OFFLOAD_ALLOCATION_FAILURES_TOTAL = "kvcache_offload_allocation_failures_total"
OFFLOAD_STORES_SKIPPED_TOTAL = "kvcache_offload_stores_skipped_total"
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
    *gpu_kit.METRICS,
    # --- config audit -----------------------------------------------------------------
    *audit_kit.METRICS,
    # --- cost and energy --------------------------------------------------------------
    *cost_kit.METRICS,
    # --- KV events ----------------------------------------------------------------------
    *kv_events_kit.EVENTS,
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
    *fleet_publish_kit.METRICS,
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
    *kv_events_kit.UNITS,
    # --- miss attribution (KV events) ---------------------------------------------------------
    *kv_events_kit.ATTRIBUTION,
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
# A declaring module's name constants are the catalog's too: catalog.GPU_POWER_WATTS is
# gpu_kit.GPU_POWER_WATTS, so call sites read every name from one place.
globals().update(
    (k, v) for m in DECLARED for k, v in vars(m).items() if k.isupper() and str(v).startswith("kvcache_")
)


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
