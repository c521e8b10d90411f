"""Pure derivations for one vLLM engine: counters, block use, windowed ratios, rates and quantiles."""

from __future__ import annotations

from .. import catalog as c
from ..samples import Sample
from ..sources.vllm_names import ADMISSION_REASONS, TIERS, WAITING_REASONS
from ..sources.vllm_snapshot import EngineSample
from .cache_config import capacity_tokens, config_number
from .fragmentation import fragmentation_estimate_ratio
from .quantiles import histogram_quantile
from .windows import Delta

CACHED_TIERS = (*TIERS, "storage")  # vLLM's sources, then SGLang's HiCache storage tier (L3)

COUNTERS = {
    c.PREFIX_CACHE_QUERY_TOKENS_TOTAL: "query_tokens",
    c.PREFIX_CACHE_HIT_TOKENS_TOTAL: "hit_tokens",
    c.GENERATION_TOKENS_TOTAL: "generation_tokens",
    c.PREEMPTIONS_TOTAL: "preemptions",
    c.EXTERNAL_PREFIX_CACHE_QUERY_TOKENS_TOTAL: "external_query_tokens",
    c.EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL: "external_hit_tokens",
    c.EVICTED_TOKENS_TOTAL: "evicted_tokens",  # SGLang's radix tree and HiCache (sglang_parse.py)
    c.TIER_LOAD_BACK_TOKENS_TOTAL: "load_back_tokens",
    c.TIER_BACKUP_TOKENS_TOTAL: "backup_tokens",
}
PROMPT_SOURCES = {"computed": "computed_prompt_tokens", "cached": "cached_prompt_tokens"}
GAUGES = {c.REQUESTS_RUNNING: "running", c.REQUESTS_WAITING: "waiting"}
RATES = {
    c.GENERATION_TOKENS_PER_SECOND: "generation_tokens",
    c.PREEMPTIONS_PER_SECOND: "preemptions",
}
LATENCIES = {
    c.PREFILL_LATENCY_SECONDS: "prefill",
    c.TIME_TO_FIRST_TOKEN_SECONDS: "ttft",
    c.QUEUE_TIME_SECONDS: "queue",
    c.E2E_LATENCY_SECONDS: "e2e",
    c.KV_BLOCK_LIFETIME_SECONDS: "block_lifetime",
    c.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS: "block_idle_before_evict",
    c.KV_BLOCK_REUSE_GAP_SECONDS: "block_reuse_gap",
    c.PREFILL_COMPUTED_TOKENS: "prefill_kv_computed",
}
# cache_config_info labels re-exported on kvcache_vllm_config_info (after model_name, engine).
CONFIG_LABELS = c.get(c.VLLM_CONFIG_INFO).labels[2:]


def hit_ratio(hits: float | None, queries: float | None) -> float | None:
    """hits/queries, or None when nothing was queried (a ratio of nothing is no series, not 0)."""
    if hits is None or not queries or queries <= 0:
        return None
    return min(max(hits / queries, 0.0), 1.0)


def current(labels: dict[str, str], sample: EngineSample, config: dict[str, str] | None) -> list[Sample]:
    """The engine's state at the latest poll."""
    out = [
        Sample(name, labels, sample.counters[key]) for name, key in COUNTERS.items() if key in sample.counters
    ]
    out += [
        Sample(c.PROMPT_TOKENS_TOTAL, {**labels, "source": source}, sample.counters[key])
        for source, key in PROMPT_SOURCES.items()
        if key in sample.counters
    ]
    out += [Sample(name, labels, sample.gauges[key]) for name, key in GAUGES.items() if key in sample.gauges]
    out += [
        Sample(c.PROMPT_TOKENS_CACHED_BY_TIER_TOTAL, {**labels, "tier": tier}, sample.counters[key])
        for tier in CACHED_TIERS
        if (key := f"cached_tier_{tier}") in sample.counters
    ]
    out += [
        Sample(c.REQUESTS_WAITING_BY_REASON, {**labels, "reason": reason}, sample.gauges[key])
        for reason in WAITING_REASONS
        if (key := f"waiting_{reason}") in sample.gauges
    ]
    out += [
        Sample(c.ADMISSION_REJECTIONS_TOTAL, {**labels, "reason": reason}, sample.counters[key])
        for reason in ADMISSION_REASONS
        if (key := f"rejected_{reason}") in sample.counters
    ]
    v0_rate = sample.gauges.get("v0_block_hit_rate")
    if v0_rate is not None and 0 <= v0_rate <= 1:
        out.append(Sample(c.VLLM_V0_PREFIX_CACHE_BLOCK_HIT_RATIO, labels, v0_rate))
    gauges = sample.gauges
    in_use = gauges.get("blocks_in_use")
    return out + blocks(labels, gauges.get("kv_usage"), gauges.get("running"), config, in_use)


def blocks(
    labels: dict[str, str],
    usage: float | None,
    running: float | None,
    config: dict[str, str] | None,
    counted: float | None = None,  # blocks in use as the engine counts them (SGLang), else from usage
) -> list[Sample]:
    out = []
    if usage is not None:
        usage = min(max(usage, 0.0), 1.0)
        out.append(Sample(c.BLOCK_UTILIZATION_RATIO, labels, usage))
    num_blocks = config_number(config, "num_gpu_blocks")
    block_size = config_number(config, "block_size")
    if num_blocks is not None:
        out.append(Sample(c.BLOCKS_CAPACITY, labels, num_blocks))
        if counted is not None or usage is not None:
            # vLLM's usage excludes the one null block: 1 - free / (num_gpu_blocks - 1).
            in_use = counted if counted is not None else round(usage * max(num_blocks - 1, 0), 6)
            out.append(Sample(c.BLOCKS_IN_USE, labels, in_use))
            fragmentation = fragmentation_estimate_ratio(block_size, in_use, running)
            if fragmentation is not None:
                out.append(Sample(c.BLOCK_FRAGMENTATION_ESTIMATE_RATIO, labels, fragmentation))
    if block_size is not None:
        out.append(Sample(c.BLOCK_SIZE_TOKENS, labels, block_size))
    capacity = capacity_tokens(config)
    if capacity is not None:
        out.append(Sample(c.CAPACITY_TOKENS, labels, capacity))
    if config is not None:
        info = {key: config.get(key, "") for key in CONFIG_LABELS}
        out.append(Sample(c.VLLM_CONFIG_INFO, {**labels, **info}, 1.0))
    return out


def windowed(labels: dict[str, str], window: str, delta: Delta, quantiles: tuple[float, ...]) -> list[Sample]:
    """Ratios, rates and latency quantiles over one window."""
    labels = {**labels, "window": window}
    out = []
    ratio = hit_ratio(delta.counters.get("hit_tokens"), delta.counters.get("query_tokens"))
    if ratio is not None:
        out.append(Sample(c.PREFIX_CACHE_HIT_RATIO, labels, ratio))
    for source, key in PROMPT_SOURCES.items():
        if key in delta.counters:
            rate = delta.counters[key] / delta.seconds
            out.append(Sample(c.PROMPT_TOKENS_PER_SECOND, {**labels, "source": source}, rate))
    out += [
        Sample(name, labels, delta.counters[key] / delta.seconds)
        for name, key in RATES.items()
        if key in delta.counters
    ]
    for name, key in LATENCIES.items():
        if key not in delta.histograms:
            continue
        hist = delta.histograms[key]
        if hist.count <= 0:
            continue
        for q in quantiles:
            value = histogram_quantile(q, hist.bounds, hist.counts)
            if value is not None:
                out.append(Sample(name, {**labels, "quantile": f"{q:g}"}, value))
        out += [
            Sample(f"{name}_count", labels, hist.count),
            Sample(f"{name}_sum", labels, max(hist.sum, 0.0)),
        ]
    return out
