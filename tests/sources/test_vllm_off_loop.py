"""A long parse runs off the event loop: /metrics answers while a 7 MiB body is parsed (issue 14 item 7)."""

from __future__ import annotations

import asyncio
import threading

import aiohttp
import pytest
from aiohttp import web

from kvcache_exporter.exposition import registry_for
from kvcache_exporter.sources import vllm
from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.vllm import ParseBounds, VllmSource, parse
from kvcache_exporter.tools.exporters import vllm_exporter
from kvcache_exporter.web.app import make_app
from tests.loopback import serve

HEAD = 'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100\n'


def huge_body(size: int = 7 * 1024 * 1024) -> str:
    """Distinct series the exporter reads (no line seen before): the slowest parse within the bound."""
    line = 'vllm:num_requests_running{{engine="0",model_name="m",pad="{:012d}"}} 1\n'
    return HEAD + "".join(line.format(i) for i in range(size // len(line.format(0))))


async def scrape_during_parse(monkeypatch) -> tuple[bool, bool]:
    body = huge_body()

    async def handler(_request):
        return web.Response(text=body)

    upstream = web.Application()
    upstream.router.add_get("/metrics", handler)
    started, finished = threading.Event(), threading.Event()

    def watched_parse(*args, **kwargs):
        started.set()
        try:
            return parse(*args, **kwargs)
        finally:
            finished.set()

    monkeypatch.setattr(vllm, "parse", watched_parse)
    up_runner, up_url = await serve(upstream)
    source = VllmSource(up_url + "/metrics", timeout=60)
    exporter = vllm_exporter({"t": source}, windows=[60], quantiles=[0.5], interval=1)
    ours = make_app(
        registry_for(lambda: exporter.latest), telemetry_path="/metrics", ready=lambda: True, users={}
    )
    our_runner, our_url = await serve(ours)
    try:
        poll = asyncio.create_task(exporter.poll_once())
        while not started.is_set():
            await asyncio.sleep(0.005)
        async with aiohttp.ClientSession() as session, session.get(our_url + "/metrics") as response:
            assert response.status == 200
            await response.read()
        answered_during_parse = not finished.is_set()
        await poll
        return answered_during_parse, finished.is_set()
    finally:
        await exporter.close()
        await our_runner.cleanup()
        await up_runner.cleanup()


def test_metrics_answers_while_a_huge_parse_is_in_progress(monkeypatch):
    answered_during_parse, parsed = asyncio.run(scrape_during_parse(monkeypatch))
    assert parsed
    assert answered_during_parse


def test_a_line_past_the_bound_is_a_parse_error_before_any_regex_runs():
    line = 'vllm:num_requests_running{engine="0",model_name="m",pad="' + "x" * 8_000_000 + '"} 1\n'
    with pytest.raises(SourceError) as err:
        parse(HEAD + line, limits=ParseBounds(max_line_chars=16 * 1024))
    assert err.value.reason == "parse_error"
    assert "longer than" in str(err.value)
