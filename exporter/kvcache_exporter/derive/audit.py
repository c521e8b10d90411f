"""Configuration checks on vLLM's cache config, per model: kvcache_config_check{model_name, check}.

Each check passes (1), fails (0), or is absent when its inputs are unknown. The list:

- prefix_caching_enabled: enable_prefix_caching is True on every engine of the model.
- gpu_memory_utilization_ceiling: on a GPU that others share (another process holds memory, or used
  memory swings: derive/memory.py's gpu_sharing), gpu_memory_utilization <= the ceiling (default 0.9)
  on every engine and the lowest free memory of the window covers its swing; passes on a GPU nobody
  shares whatever vLLM was given (its default is 0.92); absent without GPU memory telemetry.
- kv_capacity_for_concurrency: the KV cache holds the observed peak of running + waiting requests.
  Capacity in requests, summed over engines: capacity tokens / typical request tokens when the
  typical request size is known, else vLLM's kv_cache_max_concurrency (requests at max_model_len,
  a pessimistic bound).
- block_size_consistent, hash_algo_consistent: identical across the model's targets and engines
  (prefix-cache hits and routing assume one block size and one hash).
- no_deprecated_metrics: the targets expose no deprecated vLLM metric names the exporter reads.
- kv_events_received: the exporter receives vLLM's KV events (miss attribution needs them): fails
  when no stream is configured, or when prompt tokens flowed over the longest window but no batch
  ever arrived (vLLM's --kv-events-config off, or pointed elsewhere).
- kv_cache_metrics_enabled: vLLM exposes its block residency histograms (`--kv-cache-metrics`),
  which KVCacheEvictionThrashing and the residency quantiles read; checked on V1 targets only.
- attribution_memory_fits_cache: --kv-events.max-tracked-blocks is at least 10x the model's
  num_gpu_blocks (one engine's: a KV-event stream is one rank's), so an evicted block is still
  remembered when it comes back; below that, `evicted` misses read as `cold`.
- prefix_caching_effective, hybrid_kv_cache_manager_enabled, hit_unit_near_block_size,
  window_retention: what caching really does on this model (derive/audit_caching.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from .. import catalog as c
from ..samples import Sample
from .audit_caching import (
    hit_unit_near_block_size,
    hybrid_kv_cache_manager_enabled,
    prefix_caching_effective,
    window_retention,
)
from .cache_config import capacity_tokens, config_number
from .memory import GpuSharing, gpu_sharing
from .state import PollState

CacheConfig = Mapping[str, str]  # the labels of one vllm:cache_config_info series

DEFAULT_GPU_MEMORY_UTILIZATION_CEILING = 0.9
TRACKED_BLOCKS_PER_CACHE_BLOCK = 10


def _all(configs: Sequence[CacheConfig], test: Callable[[CacheConfig], bool | None]) -> bool | None:
    results = [test(config) for config in configs]
    return None if not results or None in results else all(results)


def _consistent(configs: Sequence[CacheConfig], label: str) -> bool | None:
    values = {config.get(label) for config in configs}
    return None if not configs or None in values else len(values) == 1


def capacity_requests(config: CacheConfig, typical_request_tokens: float | None) -> float | None:
    tokens = capacity_tokens(config)
    if typical_request_tokens and typical_request_tokens > 0 and tokens is not None:
        return tokens / typical_request_tokens
    return config_number(config, "kv_cache_max_concurrency")


def kv_capacity_for_concurrency(
    configs: Sequence[CacheConfig], peak_requests: float | None, typical_request_tokens: float | None
) -> bool | None:
    capacities = [capacity_requests(config, typical_request_tokens) for config in configs]
    if peak_requests is None or not capacities or None in capacities:
        return None
    return sum(capacities) >= peak_requests


def config_checks(
    model_name: str,
    configs: Sequence[CacheConfig],
    peak_requests: float | None = None,
    typical_request_tokens: float | None = None,
    deprecated_metrics: Collection[str] | None = None,
    gpu_memory_utilization_ceiling: float = DEFAULT_GPU_MEMORY_UTILIZATION_CEILING,
    kv_events_received: bool | None = None,
    kv_cache_metrics_enabled: bool | None = None,
    max_tracked_blocks: int | None = None,
    window_tokens: tuple[float, float] | None = None,
    stream_kinds: Collection[str] | None = None,
    sharing: GpuSharing | None = None,
    window_expired_tokens: float | None = None,
) -> list[Sample]:
    """configs: the cache_config_info labels of every engine serving model_name, on every target;
    window_tokens: (prompt, prefix-cache query) tokens over the longest window; stream_kinds: the
    kv_cache_spec_kind values of its stored KV events; sharing: what the GPU memory shows;
    window_expired_tokens: window_expired miss tokens over the longest window (None: no windowed group)."""

    def under_ceiling(config: CacheConfig) -> bool | None:
        value = config_number(config, "gpu_memory_utilization")
        if value is None or sharing is None:
            return None
        if not sharing.shared:
            return True  # nobody to leave memory to
        return value <= gpu_memory_utilization_ceiling and sharing.headroom_covers_swing

    def caching_on(config: CacheConfig) -> bool | None:
        value = config.get("enable_prefix_caching")
        return None if value not in ("True", "False") else value == "True"

    results = {
        "prefix_caching_enabled": _all(configs, caching_on),
        "gpu_memory_utilization_ceiling": _all(configs, under_ceiling),
        "kv_capacity_for_concurrency": kv_capacity_for_concurrency(
            configs, peak_requests, typical_request_tokens
        ),
        "block_size_consistent": _consistent(configs, "block_size"),
        "hash_algo_consistent": _consistent(configs, "prefix_caching_hash_algo"),
        "no_deprecated_metrics": None if deprecated_metrics is None else not deprecated_metrics,
        "kv_events_received": kv_events_received,
        "kv_cache_metrics_enabled": kv_cache_metrics_enabled,
        "attribution_memory_fits_cache": memory_fits_cache(configs, max_tracked_blocks),
        "prefix_caching_effective": prefix_caching_effective(*(window_tokens or (None, None))),
        "hybrid_kv_cache_manager_enabled": hybrid_kv_cache_manager_enabled(configs, stream_kinds),
        "hit_unit_near_block_size": hit_unit_near_block_size(configs),
        "window_retention": window_retention(configs, window_expired_tokens),
    }
    return [
        Sample(c.CONFIG_CHECK, {"model_name": model_name, "check": check}, float(passed))
        for check, passed in results.items()
        if passed is not None
    ]


def memory_fits_cache(configs: Sequence[CacheConfig], max_tracked_blocks: int | None) -> bool | None:
    blocks = [config_number(config, "num_gpu_blocks") for config in configs]
    if max_tracked_blocks is None or not blocks or None in blocks:
        return None
    return max_tracked_blocks >= TRACKED_BLOCKS_PER_CACHE_BLOCK * max(blocks)


def audit_samples(state: PollState, ceiling: float, windows: Sequence[float]) -> list[Sample]:
    """config_checks for every model served by a target that is up."""
    configs: dict[str, list[CacheConfig]] = {}
    deprecated: dict[str, set[str]] = {}
    residency: dict[str, bool] = {}
    for target in state.targets:
        snap = target.snapshot
        if snap is None or not target.up:
            continue
        for engine, config in snap.cache_configs.items():
            model = snap.model_of(engine)
            configs.setdefault(model, []).append(config)
            deprecated.setdefault(model, set()).update(snap.deprecated)
        if snap.schema == "v1":
            for (model, _), sample in snap.engines.items():
                residency[model] = residency.get(model, True) and "block_lifetime" in sample.histograms
    events = kv_events_received(state, max(windows))
    bounds = [part.attribution.limits[0] for part in state.kv_events if part.attribution is not None]
    # The kv_cache_spec_kind of every group the streams' BlockStored events described (derive/units.py).
    kinds = {
        group.kind
        for part in state.kv_events
        if part.units is not None
        for group in part.units.groups.values()
        if group.kind is not None
    }
    sharing = None
    if state.gpu is not None:  # vLLM's budget on the GPU: the largest gpu_memory_utilization configured
        values = [config_number(c, "gpu_memory_utilization") for cs in configs.values() for c in cs]
        utilization = max((v for v in values if v is not None), default=None)
        sharing = gpu_sharing(
            state.gpu_snapshot, state.gpu.ts, utilization, state.gpu.history.used(), max(windows)
        )
    out = []
    for model, model_configs in configs.items():
        peak = state.load_peaks.peak(model)
        out += config_checks(
            model,
            model_configs,
            peak_requests=peak,
            typical_request_tokens=typical_request_tokens(state, model, max(windows)),
            deprecated_metrics=deprecated.get(model, set()),
            gpu_memory_utilization_ceiling=ceiling,
            kv_events_received=events,
            kv_cache_metrics_enabled=residency.get(model),
            max_tracked_blocks=min(bounds, default=None),
            window_tokens=window_tokens(state, model, max(windows)),
            stream_kinds=kinds or None,
            sharing=sharing,
            window_expired_tokens=window_expired(state, max(windows)),
        )
    return out


def window_expired(state: PollState, seconds: float) -> float | None:
    """window_expired miss tokens over the window, from the streams whose group model knows a
    windowed group; None without one."""
    parts = [
        part
        for part in state.kv_events
        if part.misses is not None
        and part.units is not None
        and any(group.windowed for group in part.units.groups.values())
    ]
    deltas = [part.misses.window(seconds) for part in parts]
    if not parts:
        return None
    return sum(delta.counters.get("window_expired", 0.0) for delta in deltas if delta is not None)


def kv_events_received(state: PollState, seconds: float) -> bool | None:
    """False without a KV-event stream, or when prompts flowed but no batch ever came; None while idle."""
    if not state.kv_events:
        return False
    if any(part.events.batches > 0 for part in state.kv_events):
        return True
    prompts = 0.0
    for target in state.targets:
        for history in target.histories.values():
            delta = history.window(seconds)
            prompts += delta.counters.get("query_tokens", 0.0) if delta is not None else 0.0
    return False if prompts > 0 else None


def window_tokens(state: PollState, model: str, seconds: float) -> tuple[float, float] | None:
    """(prompt tokens, prefix-cache query tokens) of the model's engines over the window."""
    prompts = queries = 0.0
    seen = False
    for target in state.targets:
        for (name, _), history in target.histories.items():
            delta = history.window(seconds) if name == model else None
            if delta is None or not {"prompt_tokens", "query_tokens"} <= delta.counters.keys():
                continue
            seen = True
            prompts += delta.counters["prompt_tokens"]
            queries += delta.counters["query_tokens"]
    return (prompts, queries) if seen else None


def typical_request_tokens(state: PollState, model: str, seconds: float) -> float | None:
    """Mean prompt + generated tokens per finished request over the window."""
    tokens = requests = 0.0
    for target in state.targets:
        for (name, _), history in target.histories.items():
            delta = history.window(seconds) if name == model else None
            if delta is None or "e2e" not in delta.histograms:
                continue
            requests += delta.histograms["e2e"].count
            tokens += delta.counters.get("prompt_tokens", 0.0) + delta.counters.get("generation_tokens", 0.0)
    return tokens / requests if requests > 0 else None
