"""Issue 14's poisons through the whole poll path: a derived series is right or absent, never NaN,
±Inf, a negative count or rate, or a ratio outside [0, 1]; what the guard drops is counted."""

import logging
import math
import re

import pytest

from kvcache_exporter import catalog as c
from kvcache_exporter.guard import Guard, problem
from kvcache_exporter.samples import Sample
from tests.replay import replay, seed_snapshots, values


def poisoned(text: str, family: str, value: str) -> str:
    """The text with every sample of `family` (exactly that name) set to `value`."""
    return re.sub(rf"^({re.escape(family)}(?:{{[^}}]*}})?) \S+$", rf"\g<1> {value}", text, flags=re.M)


def assert_clean(exporter):
    for s in exporter.latest:
        spec = c.BY_NAME.get(s.name) or c.BY_NAME[s.name.rsplit("_", 1)[0]]
        low, high = spec.value_range
        assert math.isfinite(s.value) and low <= s.value <= high, s


@pytest.fixture
def seed(shared_fixtures):
    return [s["text"] for s in seed_snapshots(shared_fixtures)]


def test_inf_prefix_cache_counters_give_no_nan_ratio_and_it_does_not_stick(seed):
    texts = (
        seed[:20] + [poisoned(t, "vllm:prefix_cache_hits_total", "+Inf") for t in seed[20:23]] + seed[23:30]
    )
    exporter = replay(texts, windows=(60.0,))
    assert_clean(exporter)
    # after the upstream recovered, the 1m window (6 polls) holds only good points again
    ratio = values(exporter, c.PREFIX_CACHE_HIT_RATIO, window="1m")
    clean = values(replay(seed[:30], windows=(60.0,)), c.PREFIX_CACHE_HIT_RATIO, window="1m")
    assert ratio and ratio == pytest.approx(clean)


def test_inf_bucket_count_with_quantile_zero_neither_crashes_nor_exports_nan(seed):
    texts = seed[:20] + [poisoned(t, "vllm:e2e_request_latency_seconds_bucket", "+Inf") for t in seed[20:22]]
    exporter = replay(texts, windows=(60.0,), quantiles=(0.0, 0.5))
    assert_clean(exporter)
    # an impossible count fails the poll at parse (sources/vllm.py), the loop goes on
    assert values(exporter, c.VLLM_UP) == {(): 0.0}
    assert values(exporter, c.EXPORTER_ERRORS_TOTAL, collector="vllm", reason="parse_error")


def test_inf_num_gpu_blocks_gives_no_blocks_in_use_or_fragmentation(seed):
    texts = [re.sub(r'num_gpu_blocks="\d+"', 'num_gpu_blocks="inf"', t) for t in seed[:10]]
    exporter = replay(texts)
    assert_clean(exporter)
    assert values(exporter, c.BLOCKS_IN_USE) == {}
    assert values(exporter, c.BLOCK_FRAGMENTATION_ESTIMATE_RATIO) == {}
    assert values(exporter, c.BLOCK_UTILIZATION_RATIO)  # the rest of the engine is still there


def test_negative_generation_tokens_give_no_negative_count_or_rate(seed):
    poison = [poisoned(t, "vllm:generation_tokens_total", "-1000") for t in seed[20:22]]
    exporter = replay(seed[:20] + poison + seed[22:26], windows=(60.0,))
    assert_clean(exporter)
    # refused at parse (sources/vllm.py), counted, and the windows after it stay right
    assert values(exporter, c.EXPORTER_ERRORS_TOTAL, collector="vllm", reason="parse_error") == {
        (("collector", "vllm"), ("reason", "parse_error")): 2.0
    }
    totals = values(exporter, c.GENERATION_TOKENS_TOTAL)
    rates = values(exporter, c.GENERATION_TOKENS_PER_SECOND)
    assert totals and rates and all(v >= 0 for v in [*totals.values(), *rates.values()])


@pytest.mark.parametrize(
    "sample,reason",
    [
        (Sample(c.PREFIX_CACHE_HIT_RATIO, {}, math.nan), "invalid_value"),
        (Sample(c.PREFIX_CACHE_HIT_RATIO, {}, 1.5), "invalid_value"),
        (Sample(c.GENERATION_TOKENS_TOTAL, {}, math.inf), "invalid_value"),
        (Sample(c.GENERATION_TOKENS_PER_SECOND, {}, -200.0), "invalid_value"),
        (Sample(c.E2E_LATENCY_SECONDS + "_count", {}, -1.0), "invalid_value"),
        (Sample(c.GPU_MEMORY_BUDGET_USAGE_RATIO, {}, 1.2), None),  # above 1 is what it reports
        (Sample(c.GPU_TEMPERATURE_CELSIUS, {}, -5.0), None),
        (Sample(c.PREFIX_CACHE_HIT_RATIO, {}, 0.0), None),
        (Sample("kvcache_prefix_cache_hit_rato", {}, 0.5), "unknown_metric"),
    ],
)
def test_what_the_catalog_allows(sample, reason):
    assert problem(sample) == reason


def test_the_guard_counts_every_drop_and_logs_once_per_metric(caplog):
    guard = Guard()
    caplog.set_level(logging.WARNING, logger="kvcache_exporter")
    bad = Sample(c.PREFIX_CACHE_HIT_RATIO, {"window": "1m"}, math.nan)
    good = Sample(c.PREFIX_CACHE_HIT_RATIO, {"window": "5m"}, 0.5)
    for _ in range(3):
        assert guard.filter([bad, good]) == [good]
    assert guard.errors == {"invalid_value": 3}
    assert len(caplog.records) == 1


def test_label_values_from_the_data_are_printable_and_bounded():
    from prometheus_client import generate_latest

    from kvcache_exporter.exposition import registry_for
    from kvcache_exporter.samples import MAX_LABEL_CHARS, label_value

    assert label_value("a\x00b\x1b[31mc\x7f") == "a\ufffdb\ufffd[31mc\ufffd"
    assert label_value("s" * 10_000) == "s" * MAX_LABEL_CHARS
    assert label_value("llama-3 8B/ü") == "llama-3 8B/ü"  # printable text is untouched
    hostile = "sess\x00ion\x1b" + "x" * 1000
    samples = [
        Sample(c.KV_EVENTS_SESSION_TOKENS_TOTAL, {"session": hostile}, 16.0),
        Sample(c.PREFIX_DIVERGENCE_OFFSET_TOKENS + "_bucket", {"le": "+Inf", "x": "\x00"}, 1.0),
    ]
    text = generate_latest(registry_for(lambda: samples)).decode()
    line = next(x for x in text.splitlines() if x.startswith(c.KV_EVENTS_SESSION_TOKENS_TOTAL + "{"))
    assert "\x00" not in text and "\x1b" not in text
    assert f'session="sess\ufffdion\ufffd{"x" * (MAX_LABEL_CHARS - 9)}"' in line
