"""What the cost and energy derivation (derive/cost.py) declares beside its code: its catalog
entries, its options and its settings. catalog.py and config.py concatenate them in their place;
server.ROWS runs it."""

from __future__ import annotations

from dataclasses import dataclass

from ..metric import entry
from ..options import Option, at_least, price, price_table, ratio

COST_INFO = "kvcache_cost_info"
GPU_COST_PER_HOUR = "kvcache_gpu_cost_per_hour"
COST_PER_MILLION_TOKENS = "kvcache_cost_per_million_tokens"
CACHE_SAVINGS_PER_HOUR = "kvcache_cache_savings_per_hour"
CACHE_MISS_EXTRA_COST_PER_HOUR = "kvcache_cache_miss_extra_cost_per_hour"
ENERGY_JOULES_PER_TOKEN = "kvcache_energy_joules_per_token"
ENERGY_COST_PER_MILLION_TOKENS = "kvcache_energy_cost_per_million_tokens"

METRICS = (
    entry(
        COST_INFO,
        "gauge",
        "Pricing in force (value 1): the currency every cost metric uses.",
        ("currency",),
        "",
        "cost",
        "configuration",
        per_target=False,
    ),
    entry(
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
    entry(
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
    entry(
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
    entry(
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
    entry(
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
    entry(
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
)

OPTIONS = (
    Option("cost.gpu_hour_price", price, None, "price of one GPU-hour (any GPU model)"),
    Option("cost.gpu_hour_prices", price_table, {}, "price per GPU-hour by GPU model name: NAME=PRICE", True),
    Option(
        "cost.gpu_count",
        at_least(1),
        1,
        "GPUs this vLLM uses: prices the cost when no GPU telemetry is available",
    ),
    Option("cost.currency", str, "USD", "currency of the prices"),
    Option("cost.energy_price_per_kwh", price, None, "price of a kWh, for energy cost per token"),
    Option("cost.hit_ratio_floor", ratio, 0.6, "hit ratio used to price the cost of a cache collapse"),
)


@dataclass(frozen=True)
class CostSettings:
    """One field per option above (config.resolve fills them; Settings has them)."""

    cost_gpu_hour_price: float | None
    cost_gpu_hour_prices: dict[str, float]
    cost_gpu_count: int
    cost_currency: str
    cost_energy_price_per_kwh: float | None
    cost_hit_ratio_floor: float
