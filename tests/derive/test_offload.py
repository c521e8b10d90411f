"""KV offloading from vLLM 0.33's /metrics: the family names as the released wheel's source defines them
(offloading/metrics.py, kv_offload/cpu/common.py), parsed by the exporter's own parser. CPU offload does
not run on vLLM's CPU backend, so the expositions are written here in that shape."""

from kvcache_exporter.derive import offload
from kvcache_exporter.derive.windows import Delta
from kvcache_exporter.sources.vllm_parse import parse

LABELS = 'engine="0",model_name="m"'


def exposition(queries, host, store_bytes, load_bytes, store_s, load_s, failures=0, skipped=0) -> str:
    return "\n".join(
        [
            "# TYPE vllm:prefix_cache_queries counter",
            f"vllm:prefix_cache_queries_total{{{LABELS}}} {queries}",
            "# TYPE vllm:prefix_cache_hits counter",
            f"vllm:prefix_cache_hits_total{{{LABELS}}} 0",
            "# TYPE vllm:prompt_tokens_cached_by_source counter",
            f'vllm:prompt_tokens_cached_by_source_total{{{LABELS},source="host"}} {host}',
            "# TYPE vllm:kv_offload_store_bytes counter",
            f"vllm:kv_offload_store_bytes_total{{{LABELS}}} {store_bytes}",
            "# TYPE vllm:kv_offload_load_bytes counter",
            f"vllm:kv_offload_load_bytes_total{{{LABELS}}} {load_bytes}",
            "# TYPE vllm:kv_offload_store_time counter",
            f"vllm:kv_offload_store_time_total{{{LABELS}}} {store_s}",
            "# TYPE vllm:kv_offload_load_time counter",
            f"vllm:kv_offload_load_time_total{{{LABELS}}} {load_s}",
            "# TYPE vllm:kv_offload_allocation_failure counter",
            f"vllm:kv_offload_allocation_failure_total{{{LABELS}}} {failures}",
            "# TYPE vllm:kv_offload_stores_skipped counter",
            f"vllm:kv_offload_stores_skipped_total{{{LABELS}}} {skipped}",
            "",
        ]
    )


def window(before: str, after: str, seconds: float = 60.0):
    a, b = parse(before).engines[("m", "0")], parse(after).engines[("m", "0")]
    counters = {k: b.counters[k] - a.counters.get(k, 0.0) for k in b.counters}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in offload.windowed({}, "1m", Delta(seconds, counters, {}))
    }, b


def test_a_tier_that_loads_back_earns_its_hits():
    got, sample = window(exposition(0, 0, 0, 0, 0, 0), exposition(6000, 1500, 6e9, 3e9, 3.0, 1.2, 2, 5))
    assert got[("kvcache_offload_host_hit_ratio", (("window", "1m"),))] == 0.25
    assert got[("kvcache_offload_bytes_per_second", (("direction", "store"), ("window", "1m")))] == 1e8
    assert got[("kvcache_offload_bytes_per_second", (("direction", "load"), ("window", "1m")))] == 5e7
    assert got[("kvcache_offload_busy_ratio", (("direction", "load"), ("window", "1m")))] == 0.02
    assert got[("kvcache_offload_stores_without_loads", (("window", "1m"),))] == 0.0
    totals = {s.name: s.value for s in offload.current({}, sample)}
    assert totals == {
        "kvcache_offload_allocation_failures_total": 2,
        "kvcache_offload_stores_skipped_total": 5,
    }


def test_a_tier_that_only_stores_costs_and_earns_nothing():
    got, _ = window(exposition(0, 0, 0, 0, 0, 0), exposition(6000, 0, 6e9, 0, 3.0, 0.0))
    assert got[("kvcache_offload_stores_without_loads", (("window", "1m"),))] == 1.0
    assert got[("kvcache_offload_host_hit_ratio", (("window", "1m"),))] == 0.0


def test_nothing_without_an_offload_family():
    text = f"# TYPE vllm:prefix_cache_queries counter\nvllm:prefix_cache_queries_total{{{LABELS}}} 5\n"
    got, sample = window(text, text)
    assert got == {} and offload.current({}, sample) == []
