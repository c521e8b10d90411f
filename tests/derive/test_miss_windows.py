"""Attribution totals as samples: the windows joined with vLLM's counters, and the offset histogram."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.derive.attribution import Totals
from kvcache_exporter.derive.miss_windows import MissHistory, miss_samples, summed_window
from kvcache_exporter.derive.windows import Delta
from kvcache_exporter.exposition import SampleCollector


def totals(cold: int, diverged: int, extra2: int = 0, extra4: int = 0) -> Totals:
    t = Totals()
    t.tokens.update(cold=cold, prefix_diverged=diverged)
    t.extra_hit_tokens.update({2: extra2, 4: extra4})
    return t


def by_name(samples):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}


def poll(history: MissHistory, ts: float, t: Totals, vllm: dict | None):
    history.record(ts, t)
    return miss_samples(t, history, [(60, "1m")], lambda s: None if vllm is None else Delta(60, vllm, {}))


def test_coverage_and_estimates_over_a_window():
    history = MissHistory(retention=600)
    vllm = {"query_tokens": 1000.0, "hit_tokens": 200.0}
    poll(history, 0.0, totals(0, 0), None)
    out = by_name(poll(history, 60.0, totals(100, 500, 96, 160), vllm))
    assert out[("kvcache_prefix_cache_miss_attribution_coverage_ratio", (("window", "1m"),))] == 600 / 800
    estimate = "kvcache_prefix_cache_hit_ratio_estimate"
    assert out[(estimate, (("capacity_factor", "2"), ("window", "1m")))] == (200 + 96) / 1000
    assert out[(estimate, (("capacity_factor", "4"), ("window", "1m")))] == (200 + 160) / 1000
    assert out[("kvcache_prefix_cache_miss_tokens_total", (("cause", "prefix_diverged"),))] == 500


def test_no_ratio_without_traffic_and_never_above_one():
    history = MissHistory(retention=600)
    poll(history, 0.0, totals(0, 0), None)
    idle = poll(history, 30.0, totals(0, 0), {"query_tokens": 0.0})
    assert not [s for s in idle if "ratio" in s.name]
    over = {"query_tokens": 100.0, "hit_tokens": 90.0}  # 500 attributed where vLLM computed 10
    out = by_name(poll(history, 60.0, totals(500, 0, extra2=400), over))
    assert out[("kvcache_prefix_cache_miss_attribution_excess_tokens", (("window", "1m"),))] == 490
    # a fault shown, never clipped to a healthy 1.0: no coverage, no estimate built on the attribution
    assert not [name for name, _ in out if "ratio" in name]


def test_summed_window_adds_engines():
    total = summed_window([Delta(60, {"query_tokens": 3.0}, {}), None, Delta(59, {"query_tokens": 4.0}, {})])
    assert total.counters == {"query_tokens": 7.0}
    assert summed_window([None]) is None


def test_the_offset_histogram_renders_as_a_prometheus_histogram():
    t = totals(0, 0)
    t.offset_counts[2] = 3  # three offsets in (8, 16]
    t.offset_counts[-1] = 1  # one beyond the last bucket
    t.offset_sum = 10000.0
    samples = miss_samples(t, MissHistory(60), [], lambda s: None)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(lambda: samples))
    text = generate_latest(registry).decode()
    family = next(
        f for f in text_string_to_metric_families(text) if f.name == "kvcache_prefix_divergence_offset_tokens"
    )
    values = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert family.type == "histogram"
    assert values[("kvcache_prefix_divergence_offset_tokens_bucket", "8.0")] == 0
    assert values[("kvcache_prefix_divergence_offset_tokens_bucket", "16.0")] == 3
    assert values[("kvcache_prefix_divergence_offset_tokens_bucket", "+Inf")] == 4
    assert values[("kvcache_prefix_divergence_offset_tokens_count", None)] == 4
