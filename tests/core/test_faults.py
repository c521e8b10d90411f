"""Bad upstream answers: the exporter keeps serving, says what went wrong, never reports stale numbers."""

import asyncio

import pytest
from aiohttp import web

from kvcache_exporter.sources.vllm import VllmSource
from kvcache_exporter.tools.exporters import vllm_exporter
from tests.loopback import serve

GOOD = (
    'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100\n'
    'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 40\n'
)


class Upstream:
    """A real HTTP server on loopback whose answer each test chooses."""

    def __init__(self):
        self.mode = "good"
        self.seen_headers = []

    async def handler(self, request):
        self.seen_headers.append(dict(request.headers))
        if self.mode == "slow":
            await asyncio.sleep(2)
        if self.mode == "status":
            return web.Response(status=503, text="overloaded")
        if self.mode == "malformed":
            return web.Response(text='vllm:prefix_cache_queries_total{engine="0" 1\n')
        if self.mode == "huge":
            return web.Response(text="# padding\n" * 200_000 + GOOD)
        if self.mode == "redirect":
            raise web.HTTPFound("http://127.0.0.1:1/metrics")
        return web.Response(text=GOOD)


async def run_case(mode, token_file=None):
    upstream = Upstream()
    app = web.Application()
    app.router.add_get("/metrics", upstream.handler)
    runner, base = await serve(app)
    url = f"{base}/metrics"
    source = VllmSource(url, timeout=0.5, max_body_bytes=1_000_000, bearer_token_file=token_file)
    exporter = vllm_exporter({"t": source}, windows=[60], quantiles=[0.5], interval=1)
    await exporter.poll_once()  # a good poll first
    upstream.mode = mode
    await exporter.poll_once()
    await exporter.close()
    await runner.cleanup()
    return exporter, upstream


def value(exporter, name, **labels):
    hits = [
        s.value
        for s in exporter.latest
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return hits[0] if hits else None


@pytest.mark.parametrize(
    "mode,reason",
    [
        ("slow", "timeout"),
        ("status", "http_status"),
        ("malformed", "parse_error"),
        ("huge", "body_too_large"),
        ("redirect", "http_status"),
    ],
)
def test_bad_answer_sets_up_to_zero_and_counts_the_reason(mode, reason):
    exporter, _ = asyncio.run(run_case(mode))
    assert value(exporter, "kvcache_vllm_up") == 0
    assert value(exporter, "kvcache_exporter_collector_success", collector="vllm") == 0
    assert value(exporter, "kvcache_exporter_errors_total", collector="vllm", reason=reason) == 1
    assert value(exporter, "kvcache_prefix_cache_query_tokens_total") is None  # no stale numbers
    assert exporter.ready  # it did succeed once


def test_target_down_is_a_connection_error():
    async def case():
        source = VllmSource("http://127.0.0.1:1/metrics", timeout=0.5)
        exporter = vllm_exporter({"t": source}, windows=[60], quantiles=[0.5], interval=1)
        await exporter.poll_once()
        await exporter.close()
        return exporter

    exporter = asyncio.run(case())
    assert value(exporter, "kvcache_vllm_up") == 0
    assert value(exporter, "kvcache_exporter_errors_total", reason="connection") == 1
    assert not exporter.ready


def test_good_answer_after_failures_recovers(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    exporter, upstream = asyncio.run(run_case("good", str(token)))
    assert value(exporter, "kvcache_vllm_up") == 1
    assert value(exporter, "kvcache_prefix_cache_hit_tokens_total") == 40
    assert upstream.seen_headers[-1]["Authorization"] == "Bearer s3cret"


def test_gpu_source_asked_for_but_absent_reads_unavailable_not_error():
    from kvcache_exporter.config import resolve
    from kvcache_exporter.server import build_exporter

    async def case():
        settings = resolve({"vllm.url": ["http://127.0.0.1:1/metrics"], "gpu.source": "nvml"}, {}, None)
        exporter = build_exporter(settings)
        await exporter.poll_once()
        await exporter.close()
        return exporter

    exporter = asyncio.run(case())  # this machine has no NVML driver
    assert value(exporter, "kvcache_exporter_collector_success", collector="gpu") == 0
    assert value(exporter, "kvcache_exporter_errors_total", collector="gpu") is None  # absent, not an error
