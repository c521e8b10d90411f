"""`/metrics` in the shape of SGLang 0.5.23's (`--engine sglang`): its names and its three label sets.

The tokenizer's counters and latency histograms (`engine_type, is_streaming, model_name`; cached tokens
by `cache_source`, which has no `is_streaming`), the scheduler's gauges (`engine_type, model_name,
tp_rank, pp_rank, moe_ep_rank`) and the radix tree's counters (`cache_type, tp_rank, pp_rank,
dp_rank`, no `model_name`), as ../shared/fixtures/sglang-0.5.23/live-hicache-metrics.txt has them.
Data-parallel engines are summed on the tokenizer's series (SGLang has one tokenizer) and get their
own `dp_rank` elsewhere. SGLang's `cache_hit_rate` gauge (the last prefill batch's) is left out: the
exporter never reads it. Radix evictions are not simulated, so `evicted_tokens_total` is absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .exposition import ExpositionState

TOKENIZER = ["engine_type", "is_streaming", "model_name"]
SCHEDULER = ["engine_type", "model_name", "tp_rank", "pp_rank", "moe_ep_rank"]  # + dp_rank with --engines
RADIX = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
HISTOGRAMS = {  # SGLang's name: the simulator's (vLLM-named) histogram, and whose labels it has
    "time_to_first_token_seconds": ("time_to_first_token_seconds", TOKENIZER),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds", TOKENIZER),
    "queue_time_seconds": ("request_queue_time_seconds", SCHEDULER),  # the scheduler's
}


class SglangCollector:
    def __init__(self, state: Callable[[], ExpositionState]) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        yield from collect_sglang(self._state())


def make_sglang_registry(state: Callable[[], ExpositionState]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SglangCollector(state))
    return registry


def collect_sglang(state: ExpositionState) -> Iterator[Metric]:
    engines, model = state.engines, state.model_name
    tokenizer = ["unified", "false", model]

    def total(read) -> float:
        return sum(read(e) for e in engines)

    for name, documentation, read in (
        ("prompt_tokens", "Number of prefill tokens processed.", lambda e: e.stats.prompt_tokens),
        ("generation_tokens", "Number of generation tokens processed.", lambda e: e.stats.generation_tokens),
        ("num_requests", "Number of requests processed.", lambda e: sum(e.stats.request_success.values())),
    ):
        family = CounterMetricFamily(f"sglang:{name}", documentation, labels=TOKENIZER)
        family.add_metric(tokenizer, total(read))
        yield family
    cached = CounterMetricFamily(
        "sglang:cached_tokens",
        "Number of cached prompt tokens.",
        labels=["cache_source", "engine_type", "model_name"],
    )
    device = total(lambda e: e.stats.prompt_tokens_cached - e.stats.prompt_tokens_external)
    cached.add_metric(["device", "unified", model], device)
    if engines and engines[0].tier is not None:
        cached.add_metric(["host", "unified", model], total(lambda e: e.stats.prompt_tokens_external))
    yield cached
    for name, (ours, labels) in HISTOGRAMS.items():
        if engines and ours in engines[0].stats.histograms:
            merged = engines[0].stats.histograms[ours]
            family = HistogramMetricFamily(f"sglang:{name}", f"Histogram of {name}.", labels=labels)
            buckets = [list(pair) for pair in merged.cumulative()]
            for engine in engines[1:]:
                for pair, (_, count) in zip(buckets, engine.stats.histograms[ours].cumulative(), strict=True):
                    pair[1] += count
            family.add_metric(
                tokenizer if labels is TOKENIZER else ["unified", model, "0", "0", "0"],
                [tuple(p) for p in buckets],
                total(lambda e, o=ours: e.stats.histograms[o].total),
            )
            yield family
    gauges = {
        "num_running_reqs": ("The number of running requests.", lambda e: len(e.running)),
        "num_queue_reqs": ("The number of requests in the waiting queue.", lambda e: len(e.waiting)),
        "token_usage": ("The token usage.", lambda e: e.pool.usage),
        "max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.", _capacity),
        "page_size": ("KV cache page size (tokens per page).", lambda e: e.config.block_size),
        "num_pages": ("Number of pages in the KV cache pool.", lambda e: e.pool.num_gpu_blocks - 1),
        "kv_used_tokens": ("Number of used tokens in the KV cache pool.", _used),
    }
    ranks = len(engines) > 1
    for name, (documentation, read) in gauges.items():
        family = GaugeMetricFamily(f"sglang:{name}", documentation, labels=SCHEDULER + ["dp_rank"] * ranks)
        for engine in engines:
            rank = [str(engine.index)] * ranks
            family.add_metric(["unified", model, "0", "0", "0", *rank], float(read(engine)))
        yield family


def _capacity(engine) -> float:  # the simulator's pool keeps vLLM's null block: never usable
    return (engine.pool.num_gpu_blocks - 1) * engine.config.block_size


def _used(engine) -> float:
    return (engine.pool.num_gpu_blocks - 1 - engine.pool.num_free_blocks) * engine.config.block_size
