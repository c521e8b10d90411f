"""`/metrics` in the shape of real vLLM: a prometheus_client custom collector over the engines' stats."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry
from prometheus_client.samples import Sample

from .engine import Engine
from .stats import ITL_BUCKETS, TTFT_BUCKETS, Histogram

# V0's shorter bucket sets: TTFT up to 10 s, TPOT up to 2.5 s, e2e 1-60 s (vllm-metrics.md §2.7).
V0_BUCKETS = {
    "time_to_first_token_seconds": TTFT_BUCKETS[: TTFT_BUCKETS.index(10.0) + 1],
    "time_per_output_token_seconds": ITL_BUCKETS[: ITL_BUCKETS.index(2.5) + 1],
    "e2e_request_latency_seconds": (1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
}

_SAMPLED = "Sampled metrics (controlled by --kv-cache-metrics-sample)."
HELP = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "prompt_tokens_by_source": "Number of prompt tokens by source.",
    "prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "prompt_tokens_cached_by_source": "Prefix-cache hit tokens by the cache tier that supplied them: device "
    "(local HBM), host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
    "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
    "vllm:external_prefix_cache_hits.",
    "generation_tokens": "Number of generation tokens processed.",
    "request_success": "Count of successfully processed requests.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
    "request_max_num_generation_tokens": "Histogram of maximum number of requested generation tokens.",
    "request_params_n": "Histogram of the n request parameter.",
    "request_params_max_tokens": "Histogram of the max_tokens request parameter.",
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_num_preemptions": "Histogram of the number of times a request was preempted.",
    "request_prefill_kv_computed_tokens": "Histogram of new KV tokens computed during prefill "
    "(excluding cached tokens).",
    "kv_block_lifetime_seconds": "Histogram of KV cache block lifetime from allocation to eviction. "
    + _SAMPLED,
    "kv_block_idle_before_evict_seconds": "Histogram of idle time before KV cache block eviction. "
    + _SAMPLED,
    "kv_block_reuse_gap_seconds": "Histogram of time gaps between consecutive KV cache block accesses. "
    "Only the most recent accesses are recorded (ring buffer). " + _SAMPLED,
}


@dataclass
class ExpositionState:
    """What one scrape reads; `created` is the wall-clock start of the current server instance (None:
    several API servers, whose multiprocess exposition has no `_created` samples)."""

    model_name: str
    engines: list[Engine]
    created: float | None
    cache_config: Callable[[int], dict[str, str]]


class VllmCollector:
    def __init__(self, state: Callable[[], ExpositionState], schema: str = "v1") -> None:
        self._state = state
        self._schema = schema

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        if self._schema == "v0":
            yield from _collect_v0(state)
        else:
            yield from _collect_v1(state)


def make_registry(state: Callable[[], ExpositionState], schema: str = "v1") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(VllmCollector(state, schema))
    return registry


def _collect_v1(state: ExpositionState) -> Iterator[Metric]:
    engines, created = state.engines, state.created
    labels = ["engine", "model_name"]

    def per_engine(engine: Engine) -> list[str]:
        return [str(engine.index), state.model_name]

    def gauge(name: str, value: Callable[[Engine], float]) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"vllm:{name}", HELP[name], labels=labels)
        for engine in engines:
            family.add_metric(per_engine(engine), value(engine))
        return family

    def counter(name: str, value: Callable[[Engine], float]) -> CounterMetricFamily:
        family = CounterMetricFamily(f"vllm:{name}", HELP[name], labels=labels)
        for engine in engines:
            family.add_metric(per_engine(engine), value(engine), created=created)
        return family

    yield gauge("num_requests_running", lambda e: len(e.running))
    yield gauge("num_requests_waiting", lambda e: len(e.waiting))
    yield gauge("kv_cache_usage_perc", lambda e: e.pool.usage)
    yield counter("prefix_cache_queries", lambda e: e.stats.prefix_cache_queries)
    yield counter("prefix_cache_hits", lambda e: e.stats.prefix_cache_hits)
    yield counter("num_preemptions", lambda e: e.stats.num_preemptions)
    yield counter("prompt_tokens", lambda e: e.stats.prompt_tokens)
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_by_source", HELP["prompt_tokens_by_source"], labels=[*labels, "source"]
    )
    for engine in engines:
        s = engine.stats
        for source, value in (
            ("local_compute", s.prompt_tokens_computed),
            ("local_cache_hit", s.prompt_tokens_cached - s.prompt_tokens_external),
            ("external_kv_transfer", s.prompt_tokens_external),
        ):
            by_source.add_metric([*per_engine(engine), source], value, created=created)
    yield by_source
    by_tier = CounterMetricFamily(
        "vllm:prompt_tokens_cached_by_source",
        HELP["prompt_tokens_cached_by_source"],
        labels=[*labels, "source"],
    )
    for engine in engines:  # the device, and the host when a CPU offload tier is simulated
        s = engine.stats
        tiers = {
            "device": s.prompt_tokens_cached - s.prompt_tokens_external,
            "host": s.prompt_tokens_external,
        }
        for source in ("device", "host", "p2p", "disk", "external_unspecified"):
            by_tier.add_metric([*per_engine(engine), source], tiers.get(source, 0), created=created)
    yield by_tier
    yield counter("prompt_tokens_cached", lambda e: e.stats.prompt_tokens_cached)
    yield counter("generation_tokens", lambda e: e.stats.generation_tokens)
    success = CounterMetricFamily(
        "vllm:request_success", HELP["request_success"], labels=["engine", "finished_reason", "model_name"]
    )
    for engine in engines:
        for reason, value in engine.stats.request_success.items():
            success.add_metric([str(engine.index), reason, state.model_name], value, created=created)
    yield success
    for name in HELP:
        if engines and name in engines[0].stats.histograms:
            yield _histogram(
                f"vllm:{name}",
                HELP[name],
                labels,
                [(per_engine(e), e.stats.histograms[name]) for e in engines],
                created,
            )
    if engines and engines[0].tier is not None:
        yield from _collect_offload(engines, labels, per_engine, created)
    if engines and engines[0].config.max_loras:
        yield _lora_info(engines)
    info = GaugeMetricFamily(
        "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", labels=_info_labels(state, 0)
    )
    for engine in engines:
        config = state.cache_config(engine.index)
        info.add_metric([config[k] for k in sorted(config)], 1.0)
    yield info


OFFLOAD_HELP = {  # vLLM 0.33: kv_connector/v1/offloading/metrics.py, kv_offload/cpu/spec.py
    "kv_offload_load_bytes": "Total bytes loaded from offload storage to GPU.",
    "kv_offload_load_time": "Total load time from offload storage to GPU, in seconds.",
    "kv_offload_store_bytes": "Total bytes stored from GPU to offload storage.",
    "kv_offload_store_time": "Total store time from GPU to offload storage, in seconds.",
    "kv_offload_allocation_failure": "Number of KV offload store allocation attempts that failed.",
    "kv_offload_load_size": "Histogram of KV offload load operation size, in bytes.",
    "kv_offload_store_size": "Histogram of KV offload store operation size, in bytes.",
    "kv_offload_cpu_cache_usage_perc": "Fraction of CPU KV-cache space currently pinned by active transfers "
    "(0.0 = idle, 1.0 = saturated). Sustained high values indicate transfers (stores or promotions) may be "
    "dropped due to insufficient capacity.",
    "external_prefix_cache_queries": "External prefix cache queries from KV connector cross-instance cache "
    "sharing, in terms of number of queried tokens.",
    "external_prefix_cache_hits": "External prefix cache hits from KV connector cross-instance cache "
    "sharing, in terms of number of cached tokens.",
}


def _collect_offload(engines, labels, per_engine, created) -> Iterator[Metric]:
    """The CPU offload tier's families (offload.py): counters, transfer-size histograms, pinned fraction."""
    counters = (
        ("external_prefix_cache_queries", lambda t: t.stats.external_queries),
        ("external_prefix_cache_hits", lambda t: t.stats.external_hits),
        ("kv_offload_load_bytes", lambda t: t.stats.load_bytes),
        ("kv_offload_load_time", lambda t: t.stats.load_time),
        ("kv_offload_store_bytes", lambda t: t.stats.store_bytes),
        ("kv_offload_store_time", lambda t: t.stats.store_time),
        ("kv_offload_allocation_failure", lambda t: t.stats.allocation_failures),
    )
    for name, read in counters:
        family = CounterMetricFamily(f"vllm:{name}", OFFLOAD_HELP[name], labels=labels)
        for engine in engines:
            family.add_metric(per_engine(engine), read(engine.tier), created=created)
        yield family
    for name, attribute in (("kv_offload_load_size", "load_sizes"), ("kv_offload_store_size", "store_sizes")):
        series = [(per_engine(e), getattr(e.tier.stats, attribute)) for e in engines]
        yield _histogram(f"vllm:{name}", OFFLOAD_HELP[name], labels, series, created)
    pinned = GaugeMetricFamily(
        "vllm:kv_offload_cpu_cache_usage_perc", OFFLOAD_HELP["kv_offload_cpu_cache_usage_perc"], labels=labels
    )
    for engine in engines:  # transfers complete within a step here: nothing stays pinned between scrapes
        pinned.add_metric(per_engine(engine), 0.0)
    yield pinned


def _lora_info(engines: list[Engine]) -> GaugeMetricFamily:
    """vLLM's one LoRA family: no engine label, a series per (running, waiting) adapter set ever seen, its
    value when it was last seen."""
    family = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    seen: dict[tuple[str, str], float] = {}
    for engine in engines:
        for key, when in engine.lora_requests.items():
            seen[key] = max(when, seen.get(key, when))
    for (running, waiting), when in seen.items():
        family.add_metric([str(engines[0].config.max_loras), running, waiting], when)
    return family


def _info_labels(state: ExpositionState, engine_index: int) -> list[str]:
    return sorted(state.cache_config(engine_index))


def _histogram(
    name: str,
    documentation: str,
    labels: list[str],
    series: list[tuple[list[str], Histogram]],
    created: float | None,
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=labels)
    for values, histogram in series:
        family.add_metric(values, histogram.cumulative(), histogram.total)
        if created is not None:
            family.samples.append(Sample(f"{name}_created", dict(zip(labels, values, strict=True)), created))
    return family


def _collect_v0(state: ExpositionState) -> Iterator[Metric]:
    """Late-V0 names: one engine's worth (engines summed), `model_name` only, no `_created` series."""
    engines, labels, values = state.engines, ["model_name"], [state.model_name]

    def total(read: Callable[[Engine], float]) -> float:
        return sum(read(e) for e in engines)

    def gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(f"vllm:{name}", documentation, labels=labels)
        family.add_metric(values, value)
        return family

    def counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(f"vllm:{name}", documentation, labels=labels)
        family.add_metric(values, value)
        return family

    config = state.cache_config(0)
    info = GaugeMetricFamily("vllm:cache_config_info", "information of cache_config", labels=sorted(_V0_INFO))
    info.add_metric([config.get(k, "None") for k in sorted(_V0_INFO)], 1.0)
    yield info
    yield gauge(
        "num_requests_running",
        "Number of requests currently running on GPU.",
        total(lambda e: len(e.running)),
    )
    yield gauge(
        "num_requests_waiting", "Number of requests waiting to be processed.", total(lambda e: len(e.waiting))
    )
    yield gauge("num_requests_swapped", "Number of requests swapped to CPU.", 0)
    yield gauge(
        "gpu_cache_usage_perc",
        "GPU KV-cache usage. 1 means 100 percent usage.",
        total(lambda e: e.pool.usage) / max(len(engines), 1),
    )
    yield gauge("cpu_cache_usage_perc", "CPU KV-cache usage. 1 means 100 percent usage.", 0)
    queries = total(lambda e: e.stats.prefix_cache_queries)
    hit_rate = total(lambda e: e.stats.prefix_cache_hits) / queries if queries else 0.0
    yield gauge("gpu_prefix_cache_hit_rate", "GPU prefix cache block hit rate.", hit_rate)
    yield gauge("cpu_prefix_cache_hit_rate", "CPU prefix cache block hit rate.", -1.0)
    yield counter(
        "num_preemptions",
        "Cumulative number of preemption from the engine.",
        total(lambda e: e.stats.num_preemptions),
    )
    yield counter(
        "prompt_tokens", "Number of prefill tokens processed.", total(lambda e: e.stats.prompt_tokens)
    )
    yield counter(
        "generation_tokens",
        "Number of generation tokens processed.",
        total(lambda e: e.stats.generation_tokens),
    )
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=["finished_reason", "model_name"],
    )
    for reason in ("stop", "length"):
        success.add_metric([reason, state.model_name], total(lambda e, r=reason: e.stats.request_success[r]))
    yield success
    for name, v1_name in (
        ("time_to_first_token_seconds", "time_to_first_token_seconds"),
        ("time_per_output_token_seconds", "inter_token_latency_seconds"),
        ("e2e_request_latency_seconds", "e2e_request_latency_seconds"),
    ):
        merged = Histogram(V0_BUCKETS[name])
        for engine in engines:
            _rebucket(engine.stats.histograms[v1_name], merged)
        yield _histogram(f"vllm:{name}", HELP.get(name, HELP[v1_name]), labels, [(values, merged)], None)


_V0_INFO = (
    "block_size",
    "cache_dtype",
    "enable_prefix_caching",
    "gpu_memory_utilization",
    "num_cpu_blocks",
    "num_gpu_blocks",
    "num_gpu_blocks_override",
    "sliding_window",
    "swap_space_bytes",
)


def _rebucket(source: Histogram, target: Histogram) -> None:
    """Move V1 observations into coarser V0 buckets (each V1 bucket lands where its upper bound falls)."""
    for bound, count in zip([*source.buckets, float("inf")], source.counts, strict=True):
        if count:
            target.counts[_bucket_index(target.buckets, bound)] += count
    target.total += source.total


def _bucket_index(buckets: tuple[float, ...], value: float) -> int:
    for index, bound in enumerate(buckets):
        if value <= bound:
            return index
    return len(buckets)
