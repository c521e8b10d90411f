"""The simulator's /metrics has the same families, types, label names and buckets as real vLLM 0.32."""

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.simulator.config import SimulatorConfig, cache_config_labels
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request
from kvcache_exporter.simulator.exposition import ExpositionState, make_registry
from kvcache_exporter.simulator.sglang_exposition import make_sglang_registry

REQUIRED = {
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:prompt_tokens_by_source",
    "vllm:prompt_tokens_cached",
    "vllm:generation_tokens",
    "vllm:num_preemptions",
    "vllm:request_success",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:time_to_first_token_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_prefill_kv_computed_tokens",
    "vllm:iteration_tokens_total",
}


def shape(text: str) -> dict[str, tuple]:
    """name -> (type, label names, bucket bounds, sample suffixes)."""
    out = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("vllm:"):
            continue
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        buckets = tuple(sorted({s.labels["le"] for s in family.samples if "le" in s.labels}, key=float))
        suffixes = frozenset(s.name[len(family.name) :] for s in family.samples)
        out[family.name] = (family.type, labels, buckets, suffixes)
    return out


def simulated_text(max_model_len: int, schema: str = "v1") -> str:
    config = SimulatorConfig(
        engine=EngineConfig(block_size=32, num_gpu_blocks=64, max_model_len=max_model_len)
    )
    engine = Engine(config.engine)
    engine.add_request(Request("r", list(range(5, 105)), 4, 0.0))
    while engine.has_work:
        engine.step(0.0)
    state = ExpositionState("tiny-llama", [engine], 1.0, lambda i: cache_config_labels(config, i))
    registry = (
        make_sglang_registry(lambda: state) if schema == "sglang" else make_registry(lambda: state, schema)
    )
    return generate_latest(registry).decode()


def test_families_match_the_real_capture(real_metrics_text):
    real = shape(real_metrics_text)
    ours = shape(simulated_text(max_model_len=1024))
    assert set(ours) >= REQUIRED
    for name in REQUIRED:
        assert ours[name] == real[name], name


def test_cache_config_info_has_every_real_label(real_metrics_text, seed_run):
    real = shape(real_metrics_text)["vllm:cache_config_info"][1]
    ours = shape(simulated_text(1024))["vllm:cache_config_info"][1]
    assert ours == real == set(seed_run["cache_config_info_labels"])


def test_counters_agree_with_each_other():
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(simulated_text(1024))
        for s in f.samples
    }
    ml = (("engine", "0"), ("model_name", "tiny-llama"))
    assert (
        samples[("vllm:prefix_cache_queries_total", ml)] == samples[("vllm:prompt_tokens_total", ml)] == 100
    )
    assert samples[("vllm:generation_tokens_total", ml)] == 4
    assert samples[("vllm:request_success_total", (*ml[:1], ("finished_reason", "length"), ml[1]))] == 1


def test_v0_schema_has_v0_names_and_no_engine_label():
    families = {f.name: f for f in text_string_to_metric_families(simulated_text(1024, "v0"))}
    assert "vllm:gpu_cache_usage_perc" in families and "vllm:kv_cache_usage_perc" not in families
    assert families["vllm:gpu_prefix_cache_hit_rate"].type == "gauge"
    assert all("engine" not in s.labels for f in families.values() for s in f.samples)
    assert not any(s.name.endswith("_created") for f in families.values() for s in f.samples)
    e2e = {s.labels["le"] for s in families["vllm:e2e_request_latency_seconds"].samples if "le" in s.labels}
    assert min(map(float, e2e)) == 1.0


def test_sglang_schema_has_sglangs_names_types_and_label_sets(shared_fixtures):
    """`--engine sglang`: every family the simulator serves is in a real SGLang 0.5.23 page with the same
    type and label names; the exporter reads it as SGLang's, its hit tokens the simulator's own."""
    from kvcache_exporter.sources.sglang_parse import parse

    real = (shared_fixtures / "sglang-0.5.23" / "live-hicache-metrics.txt").read_text()
    real_shape = {
        f.name: (f.type, frozenset(k for s in f.samples for k in s.labels if k != "le"))
        for f in text_string_to_metric_families(real)
    }
    text = simulated_text(1024, "sglang")
    simulated = list(text_string_to_metric_families(text))
    assert len(simulated) >= 12
    for family in simulated:
        labels = frozenset(k for s in family.samples for k in s.labels if k != "le")
        assert real_shape.get(family.name) == (family.type, labels), family.name
    snapshot = parse(text)
    (sample,) = snapshot.engines.values()
    assert snapshot.engine_kind == "sglang" and snapshot.missing == ()
    assert sample.counters["query_tokens"] == 100 and sample.counters["hit_tokens"] == 0
    assert snapshot.cache_configs["0"]["block_size"] == "32"
