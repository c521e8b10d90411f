"""Token cost, cache savings and energy per token: pure arithmetic on window increases.

The GPU bill over a window is split between prompt and generation tokens by the share of
request time spent in prefill vs decode (increases of vllm:request_prefill_time_seconds_sum and
vllm:request_decode_time_seconds_sum). Those are per-request times that overlap in a batch, so
only their ratio is used, never their absolute value. Every function returns None rather than a
number it cannot stand behind (no tokens, no price, no time split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import catalog as c
from ..durations import window_label
from ..samples import Sample
from .state import PollState

JOULES_PER_KWH = 3.6e6
MILLION = 1e6
DEFAULT_HIT_RATIO_FLOOR = 0.6


@dataclass(frozen=True)
class Pricing:
    """gpu_hour_price: one price for every GPU, or a table by GPU model name as NVML/DCGM report it
    (e.g. "NVIDIA H100 80GB HBM3"), optionally with a "default" entry."""

    gpu_hour_price: float | Mapping[str, float] | None = None
    currency: str = "USD"
    energy_price_per_kwh: float | None = None
    hit_ratio_floor: float = DEFAULT_HIT_RATIO_FLOOR


@dataclass(frozen=True)
class WindowUsage:
    """Increases over one window (counter resets handled by the caller) and its duration."""

    window_seconds: float
    prompt_tokens: float  # all prompt tokens, cached ones included (vllm:prompt_tokens_total)
    generation_tokens: float
    cached_tokens: float  # prompt tokens served from the prefix cache
    prefill_seconds: float | None = None
    decode_seconds: float | None = None
    energy_joules: float | None = None  # energy-counter increase, summed over GPUs
    mean_power_watts: float | None = None  # fallback when no energy counter exists


@dataclass(frozen=True)
class TokenCosts:
    """Currency per token."""

    all: float | None
    prompt: float | None
    generation: float | None
    computed_prompt: float | None  # prefill cost over prompt tokens that were actually computed


def _positive(value: float | None) -> bool:
    return value is not None and value > 0


def gpu_cost_per_hour(gpu_names: Sequence[str], price: float | Mapping[str, float] | None) -> float | None:
    """Sum of the hourly price of each GPU; None without GPUs or when a GPU model has no price."""
    if price is None or not gpu_names:
        return None
    if isinstance(price, int | float):
        return price * len(gpu_names) if price >= 0 else None
    prices = [price.get(name, price.get("default")) for name in gpu_names]
    if any(p is None or p < 0 for p in prices):
        return None
    return sum(prices)


def prefill_share(prefill_seconds: float | None, decode_seconds: float | None) -> float | None:
    if prefill_seconds is None or decode_seconds is None or prefill_seconds < 0 or decode_seconds < 0:
        return None
    total = prefill_seconds + decode_seconds
    return prefill_seconds / total if total > 0 else None


def token_costs(cost_per_hour: float | None, usage: WindowUsage) -> TokenCosts:
    if cost_per_hour is None or cost_per_hour < 0 or not _positive(usage.window_seconds):
        return TokenCosts(None, None, None, None)
    window_cost = cost_per_hour * usage.window_seconds / 3600
    total_tokens = usage.prompt_tokens + usage.generation_tokens
    share = prefill_share(usage.prefill_seconds, usage.decode_seconds)
    computed = usage.prompt_tokens - usage.cached_tokens

    def per_token(cost: float | None, tokens: float) -> float | None:
        return cost / tokens if cost is not None and tokens > 0 else None

    prefill_cost = None if share is None else window_cost * share
    decode_cost = None if share is None else window_cost * (1 - share)
    return TokenCosts(
        all=per_token(window_cost, total_tokens),
        prompt=per_token(prefill_cost, usage.prompt_tokens),
        generation=per_token(decode_cost, usage.generation_tokens),
        computed_prompt=per_token(prefill_cost, computed),
    )


def cache_savings_per_hour(costs: TokenCosts, usage: WindowUsage) -> float | None:
    """Cached prompt tokens per hour priced as computed prompt tokens."""
    if costs.computed_prompt is None or usage.cached_tokens < 0:
        return None
    return usage.cached_tokens * 3600 / usage.window_seconds * costs.computed_prompt


def cache_miss_extra_cost_per_hour(costs: TokenCosts, usage: WindowUsage, floor: float) -> float | None:
    """Extra cost per hour if the hit ratio fell to `floor`: the cached tokens above floor x prompt
    tokens would have to be computed. 0 when the hit ratio is already at or under the floor."""
    if costs.computed_prompt is None or usage.prompt_tokens <= 0:
        return None
    lost_hits = max(0.0, usage.cached_tokens - floor * usage.prompt_tokens)
    return lost_hits * 3600 / usage.window_seconds * costs.computed_prompt


def energy_joules_per_token(usage: WindowUsage) -> float | None:
    """Energy-counter increase per token; without a counter, mean power x window duration."""
    tokens = usage.prompt_tokens + usage.generation_tokens
    energy = usage.energy_joules
    if energy is None and usage.mean_power_watts is not None:
        energy = usage.mean_power_watts * usage.window_seconds
    if energy is None or energy < 0 or tokens <= 0:
        return None
    return energy / tokens


def energy_cost_per_million_tokens(
    joules_per_token: float | None, price_per_kwh: float | None
) -> float | None:
    if joules_per_token is None or price_per_kwh is None or price_per_kwh < 0:
        return None
    return joules_per_token * MILLION / JOULES_PER_KWH * price_per_kwh


def cost_info_samples(pricing: Pricing, gpu_names: Sequence[str]) -> list[Sample]:
    """kvcache_cost_info and kvcache_gpu_cost_per_hour (the latter absent without a price)."""
    samples = [Sample(c.COST_INFO, {"currency": pricing.currency}, 1.0)]
    hourly = gpu_cost_per_hour(gpu_names, pricing.gpu_hour_price)
    if hourly is not None:
        samples.append(Sample(c.GPU_COST_PER_HOUR, {}, hourly))
    return samples


def cost_window_samples(
    window: str, usage: WindowUsage, cost_per_hour: float | None, pricing: Pricing
) -> list[Sample]:
    """The cost and energy samples for one window (label `window`, e.g. "5m")."""
    costs = token_costs(cost_per_hour, usage)
    joules = energy_joules_per_token(usage)
    by_kind = (("all", costs.all), ("prompt", costs.prompt), ("generation", costs.generation))
    values = [
        *(
            (
                c.COST_PER_MILLION_TOKENS,
                {"token_kind": kind, "window": window},
                None if per is None else per * MILLION,
            )
            for kind, per in by_kind
        ),
        (c.CACHE_SAVINGS_PER_HOUR, {"window": window}, cache_savings_per_hour(costs, usage)),
        (
            c.CACHE_MISS_EXTRA_COST_PER_HOUR,
            {"window": window},
            cache_miss_extra_cost_per_hour(costs, usage, pricing.hit_ratio_floor),
        ),
        (c.ENERGY_JOULES_PER_TOKEN, {"window": window}, joules),
        (
            c.ENERGY_COST_PER_MILLION_TOKENS,
            {"window": window},
            energy_cost_per_million_tokens(joules, pricing.energy_price_per_kwh),
        ),
    ]
    return [Sample(name, labels, value) for name, labels, value in values if value is not None]


def window_usage(state: PollState, seconds: float) -> WindowUsage | None:
    """Token and time increases over the window, summed over every target and engine, and GPU energy."""
    prompt = generation = cached = prefill = decode = span = 0.0
    for target in state.targets:
        for history in target.histories.values():
            delta = history.window(seconds)
            if delta is None:
                continue
            span = max(span, delta.seconds)
            prompt += delta.counters.get("prompt_tokens", 0.0)
            generation += delta.counters.get("generation_tokens", 0.0)
            cached += delta.counters.get("cached_prompt_tokens", 0.0)
            prefill += delta.histograms["prefill"].sum if "prefill" in delta.histograms else 0.0
            decode += delta.histograms["decode"].sum if "decode" in delta.histograms else 0.0
    if span <= 0:
        return None
    gpu = state.gpu.history if state.gpu is not None else None
    return WindowUsage(
        window_seconds=span,
        prompt_tokens=prompt,
        generation_tokens=generation,
        cached_tokens=cached,
        prefill_seconds=prefill,
        decode_seconds=decode,
        energy_joules=gpu.energy_increase(span, state.now) if gpu else None,
        mean_power_watts=gpu.mean_power(span, state.now) if gpu else None,
    )


def cost_samples(
    state: PollState, pricing: Pricing, gpu_count: int, windows: Sequence[float]
) -> list[Sample]:
    """Without GPU telemetry the configured GPU count is priced at the single (or "default") price."""
    snapshot = state.gpu_snapshot
    names = [d.name for d in snapshot.devices] if snapshot else ["unknown"] * gpu_count
    hourly = gpu_cost_per_hour(names, pricing.gpu_hour_price)
    out = cost_info_samples(pricing, names)
    for seconds in windows:
        usage = window_usage(state, seconds)
        if usage is not None:
            out += cost_window_samples(window_label(seconds), usage, hourly, pricing)
    return out
