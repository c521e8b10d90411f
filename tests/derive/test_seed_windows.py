"""Window arithmetic on the real seed-scenario run (raw prompts, then normalized prompts)."""

import re

import pytest

from tests.replay import replay, seed_snapshots, values


def counter(text, name):
    return float(re.search(rf"^{name}{{[^}}]*}} (\S+)$", text, re.M).group(1))


@pytest.fixture
def snapshots(shared_fixtures):
    snaps = seed_snapshots(shared_fixtures)
    assert [s["n_done"] for s in snaps][:3] == [0, 10, 20] and snaps[16]["n_done"] == 160
    return [s["text"] for s in snaps]


def ratio(exporter, window):
    found = values(exporter, "kvcache_prefix_cache_hit_ratio", window=window)
    assert len(found) == 1
    return next(iter(found.values()))


def test_raw_phase_has_zero_hits(snapshots):
    exporter = replay(snapshots[:17], windows=(160.0,))  # polls 10 s apart: the window is the raw phase
    assert ratio(exporter, "2m40s") == 0.0


def test_normalized_phase_ratio_matches_the_recorded_counters(snapshots):
    exporter = replay(snapshots, windows=(160.0,))
    assert ratio(exporter, "2m40s") == pytest.approx(35008 / 40970)  # README: 0.8545


def test_one_minute_window_is_the_last_six_polls(snapshots):
    exporter = replay(snapshots, windows=(60.0,))
    hits = counter(snapshots[-1], "vllm:prefix_cache_hits_total") - counter(
        snapshots[-7], "vllm:prefix_cache_hits_total"
    )
    queries = counter(snapshots[-1], "vllm:prefix_cache_queries_total") - counter(
        snapshots[-7], "vllm:prefix_cache_queries_total"
    )
    assert ratio(exporter, "1m") == pytest.approx(hits / queries)


def test_a_restart_inside_the_window_neither_spikes_nor_goes_negative(snapshots):
    # vLLM restarts after the normalized phase and replays the run from zero.
    exporter = replay(snapshots + snapshots[:5], windows=(100.0,))
    last, base = snapshots[4], snapshots[-6]  # window of 100 s = 10 polls: 5 before and 5 after the restart
    q = counter(snapshots[-1], "vllm:prefix_cache_queries_total") - counter(
        base, "vllm:prefix_cache_queries_total"
    )
    h = counter(snapshots[-1], "vllm:prefix_cache_hits_total") - counter(base, "vllm:prefix_cache_hits_total")
    q += counter(last, "vllm:prefix_cache_queries_total")  # after the reset everything counts from zero
    h += counter(last, "vllm:prefix_cache_hits_total")
    assert 0 <= ratio(exporter, "1m40s") <= 1
    assert ratio(exporter, "1m40s") == pytest.approx(h / q)


def test_prefill_quantile_over_the_run_uses_bucket_deltas(snapshots):
    exporter = replay(snapshots, windows=(600.0,), quantiles=(0.5,))
    found = values(exporter, "kvcache_prefill_latency_seconds", window="10m", quantile="0.5")
    # every request of this CPU run prefilled in under 0.3 s: the median interpolates inside (0, 0.3]
    assert list(found.values()) == [pytest.approx(0.15)]


def test_idle_window_has_no_ratio_series(snapshots):
    exporter = replay(snapshots + [snapshots[-1]] * 8, windows=(60.0,))
    assert values(exporter, "kvcache_prefix_cache_hit_ratio", window="1m") == {}
    assert values(exporter, "kvcache_prefix_cache_query_tokens_total")  # the counters stay
