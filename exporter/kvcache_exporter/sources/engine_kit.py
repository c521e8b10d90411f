"""What the engine source (an engine's /metrics: vLLM's, or SGLang's read into the same snapshot;
sources/vllm.py, sources/sglang.py) declares beside its code: its catalog entries (CACHE, OFFLOAD,
HEALTH, each in its place in catalog.py), its options, its settings and their check. server.ROWS
wires it (source_rows.wire_engines). The options `aggregate` shares (timeout, body limit) keep their
fields in settings.ServiceSettings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..metric import ME, entry
from ..options import Option, choice, duration, http_url, positive_size

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
PROMPT_TOKENS_CACHED_BY_TIER_TOTAL = "kvcache_prompt_tokens_cached_by_tier_total"
EVICTED_TOKENS_TOTAL = "kvcache_evicted_tokens_total"
TIER_LOAD_BACK_TOKENS_TOTAL = "kvcache_tier_load_back_tokens_total"
TIER_BACKUP_TOKENS_TOTAL = "kvcache_tier_backup_tokens_total"
REQUESTS_WAITING_BY_REASON = "kvcache_requests_waiting_by_reason"
ADMISSION_REJECTIONS_TOTAL = "kvcache_admission_rejections_total"
KV_BLOCK_LIFETIME_SECONDS = "kvcache_kv_block_lifetime_seconds"
KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS = "kvcache_kv_block_idle_before_evict_seconds"
KV_BLOCK_REUSE_GAP_SECONDS = "kvcache_kv_block_reuse_gap_seconds"
PREFILL_COMPUTED_TOKENS = "kvcache_prefill_computed_tokens"
EXTERNAL_PREFIX_CACHE_QUERY_TOKENS_TOTAL = "kvcache_external_prefix_cache_query_tokens_total"
EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL = "kvcache_external_prefix_cache_hit_tokens_total"
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

CACHE = (
    entry(
        PREFIX_CACHE_QUERY_TOKENS_TOTAL,
        "counter",
        "Prompt tokens looked up in vLLM's prefix cache, normalized across vLLM versions.",
        ME,
        "tokens",
        source="vllm:prefix_cache_queries_total; vllm:gpu_prefix_cache_queries_total (blocks x block_size "
        "when its HELP says blocks)",
        formula="copied (reset-safe: it resets when vLLM restarts, like vLLM's own counter)",
    ),
    entry(
        PREFIX_CACHE_HIT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens served from vLLM's prefix cache, normalized across vLLM versions.",
        ME,
        "tokens",
        source="vllm:prefix_cache_hits_total; vllm:gpu_prefix_cache_hits_total",
        formula="copied",
    ),
    entry(
        PREFIX_CACHE_HIT_RATIO,
        "gauge",
        "Share of queried prompt tokens that hit the prefix cache over the window; absent when the window "
        "saw no queries.",
        (*ME, "window"),
        "ratio",
        source="vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total",
        formula="increase(hits)/increase(queries) over the window, counter resets handled like rate()",
    ),
    entry(
        VLLM_V0_PREFIX_CACHE_BLOCK_HIT_RATIO,
        "gauge",
        "V0 engines only: vLLM's own lifetime block hit-rate gauge (no token counters exist in V0).",
        ME,
        "ratio",
        source="vllm:gpu_prefix_cache_hit_rate",
        formula="copied; the -1 that V0 reports when prefix caching is off is dropped",
    ),
    entry(
        PROMPT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens by where their KV came from: computed (prefill work) or cached (prefix-cache hit).",
        (*ME, "source"),
        "tokens",
        source="vllm:prompt_tokens_by_source_total, else vllm:prompt_tokens_total - prefix cache hits",
        formula="computed = local_compute; cached = local_cache_hit + external_kv_transfer",
    ),
    entry(
        PROMPT_TOKENS_PER_SECOND,
        "gauge",
        "Prompt tokens per second over the window, computed vs cached.",
        (*ME, "source", "window"),
        "tokens/s",
        source=PROMPT_TOKENS_TOTAL,
        formula="increase/window duration",
    ),
    entry(
        GENERATION_TOKENS_TOTAL,
        "counter",
        "Generated (decode) tokens.",
        ME,
        "tokens",
        source="vllm:generation_tokens_total",
        formula="copied",
    ),
    entry(
        GENERATION_TOKENS_PER_SECOND,
        "gauge",
        "Generated tokens per second over the window.",
        (*ME, "window"),
        "tokens/s",
        source="vllm:generation_tokens_total",
        formula="increase/window duration",
    ),
    entry(
        PREEMPTIONS_TOTAL,
        "counter",
        "Requests preempted because KV blocks ran out.",
        ME,
        source="vllm:num_preemptions_total",
        formula="copied",
    ),
    entry(
        PREEMPTIONS_PER_SECOND,
        "gauge",
        "Preemptions per second over the window.",
        (*ME, "window"),
        "1/s",
        source="vllm:num_preemptions_total",
        formula="increase/window duration",
    ),
    # --- blocks ---------------------------------------------------------------------
    entry(
        BLOCK_UTILIZATION_RATIO,
        "gauge",
        "Share of KV blocks referenced by running requests (evictable cached blocks count as free).",
        ME,
        "ratio",
        source="vllm:kv_cache_usage_perc (0-1); vllm:gpu_cache_usage_perc",
        formula="copied, clamped to 0-1",
        group="blocks",
    ),
    entry(
        BLOCKS_CAPACITY,
        "gauge",
        "KV blocks vLLM allocated for this engine.",
        ME,
        "blocks",
        source="vllm:cache_config_info{num_gpu_blocks}",
        formula="num_gpu_blocks",
        group="blocks",
    ),
    entry(
        BLOCKS_IN_USE,
        "gauge",
        "KV blocks referenced by running requests.",
        ME,
        "blocks",
        source="vllm:kv_cache_usage_perc, vllm:cache_config_info{num_gpu_blocks}",
        formula="utilization x (num_gpu_blocks - 1), the null block excluded as vLLM does",
        group="blocks",
    ),
    entry(
        BLOCK_SIZE_TOKENS,
        "gauge",
        "Tokens per KV block.",
        ME,
        "tokens",
        source="vllm:cache_config_info{block_size}",
        formula="block_size",
        group="blocks",
    ),
    entry(
        CAPACITY_TOKENS,
        "gauge",
        "Tokens the KV cache can hold.",
        ME,
        "tokens",
        source="vllm:cache_config_info{kv_cache_size_tokens}, else num_gpu_blocks x block_size",
        formula="kv_cache_size_tokens or num_gpu_blocks x block_size",
        group="blocks",
    ),
    entry(
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
    entry(
        REQUESTS_RUNNING,
        "gauge",
        "Requests in the model's running batch.",
        ME,
        source="vllm:num_requests_running",
        formula="copied",
        group="blocks",
    ),
    entry(
        REQUESTS_WAITING,
        "gauge",
        "Requests waiting to be scheduled.",
        ME,
        source="vllm:num_requests_waiting",
        formula="copied",
        group="blocks",
    ),
    entry(
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
        entry(
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
    entry(
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
    entry(
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
    entry(
        TIER_LOAD_BACK_TOKENS_TOTAL,
        "counter",
        "Tokens loaded back from the host tier into the device pool (SGLang HiCache only).",
        ME,
        "tokens",
        "sglang",
        "sglang:load_back_tokens_total",
        "copied (tensor-parallel rank 0)",
    ),
    entry(
        TIER_BACKUP_TOKENS_TOTAL,
        "counter",
        "Tokens written to the host tier (SGLang HiCache only; write-through: every device store).",
        ME,
        "tokens",
        "sglang",
        "sglang:hicache_backup_tokens_total",
        "copied (tensor-parallel rank 0)",
    ),
    entry(
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
    entry(
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
        entry(
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
    entry(
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
        entry(
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
)


OFFLOAD = (
    entry(
        OFFLOAD_BYTES_PER_SECOND,
        "gauge",
        "KV offload transfer rate over the window: direction=load (offload tier -> GPU), store (GPU -> "
        "tier). Absent where vLLM exports no offload family.",
        ("model_name", "engine", "window", "direction"),
        "bytes_per_second",
        "cache",
        "vllm:kv_offload_{load,store}_bytes (else vllm:kv_offload_tiering_{read,write}_bytes)",
    ),
    entry(
        OFFLOAD_BUSY_RATIO,
        "gauge",
        "Share of the window vLLM spent transferring KV to (store) or from (load) the offload tier, summed "
        "over transfers (capped at 1).",
        ("model_name", "engine", "window", "direction"),
        "ratio",
        "cache",
        "vllm:kv_offload_{load,store}_time (else vllm:kv_offload_tiering_{read,write}_time)",
    ),
    entry(
        OFFLOAD_HOST_HIT_RATIO,
        "gauge",
        "Share of the window's prompt tokens served from the host (CPU) tier.",
        ("model_name", "engine", "window"),
        "ratio",
        "cache",
        'vllm:prompt_tokens_cached_by_source_total{source="host"}, vllm:prefix_cache_queries_total',
    ),
    entry(
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
    entry(
        OFFLOAD_ALLOCATION_FAILURES_TOTAL,
        "counter",
        "KV offload store allocation attempts that failed (the tier was full).",
        ("model_name", "engine"),
        "",
        "cache",
        "vllm:kv_offload_allocation_failure",
    ),
    entry(
        OFFLOAD_STORES_SKIPPED_TOTAL,
        "counter",
        "KV offload stores the CPU tier skipped.",
        ("model_name", "engine"),
        "",
        "cache",
        "vllm:kv_offload_stores_skipped",
    ),
)


HEALTH = (
    entry(
        VLLM_UP,
        "gauge",
        "1 when the last poll of vLLM's /metrics succeeded.",
        (),
        "",
        "health",
        "HTTP poll",
    ),
    entry(
        VLLM_SCHEMA_INFO,
        "gauge",
        "Which vLLM metric naming generation the target exposes (value 1).",
        ("schema", "prefix"),
        "",
        "health",
        "metric names on the scrape",
        "v1 (current names), v1-deprecated (gpu_prefix_cache_*, gpu_cache_usage_perc), v0",
    ),
    entry(
        VLLM_DEPRECATED_METRICS,
        "gauge",
        "Deprecated vLLM metric names the target still exposes and the exporter reads.",
        (),
        "",
        "health",
        "metric names on the scrape",
    ),
    entry(
        VLLM_MISSING_METRICS,
        "gauge",
        "Expected vLLM metrics missing from the scrape (a rename would otherwise zero a dashboard).",
        (),
        "",
        "health",
        "metric names on the scrape",
    ),
)

OPTIONS = (
    Option(
        "vllm.url",
        http_url,
        ["http://127.0.0.1:8000/metrics"],
        "vLLM /metrics URL; repeat for several servers",
        True,
    ),
    Option("vllm.timeout", duration, 5.0, "timeout of one poll of vLLM"),
    Option(
        "vllm.bearer_token_file", str, None, "file holding a bearer token sent to vLLM (re-read every poll)"
    ),
    Option("vllm.max_body_bytes", positive_size, 8 * 1024**2, "largest /metrics body accepted from vLLM"),
    Option(
        "engine.kind",
        choice("auto", "vllm", "sglang"),
        "auto",
        "the engine behind --vllm.url: auto (told by each page's metric names), vllm or sglang",
        flag_name="--engine",
    ),
)

SECTIONS = (CACHE, OFFLOAD, HEALTH)  # each in its own place in catalog.py
METRICS = CACHE + OFFLOAD + HEALTH


@dataclass(frozen=True)
class EngineSettings:
    """One field per serve-only option above (config.resolve fills them; Settings has them)."""

    vllm_url: list[str]
    vllm_bearer_token_file: str | None
    engine_kind: str


def checks(s: Any) -> list[tuple[str, str]]:
    """`s`: serve's Settings."""
    return [] if s.vllm_url else [("--vllm.url", "at least one vLLM URL is needed")]
