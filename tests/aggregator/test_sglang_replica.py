"""An SGLang replica's /metrics in `aggregate`: the real captured 0.5.23 page served from loopback
beside a vLLM page, read by the same EngineSource as `serve` (`auto` decides from the page, an
`,sglang` replica insists), so a mixed pool's ratios include the SGLang replica's counters."""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvcache_exporter.aggregator.discovery import StaticSd, replica_for
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from tests.loopback import serve
from tests.sources.test_http import Upstream
from tests.sources.test_vllm_hostile import PAYLOAD

PROMPT = 'sglang:prompt_tokens_total{engine_type="unified",is_streaming="false",model_name="tiny-llama"} '
CACHED = 'sglang:cached_tokens_total{cache_source="device",engine_type="unified",model_name="tiny-llama"} '


def values(samples, name):
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


def per_replica(samples, name):
    return {dict(labels)["replica"]: value for labels, value in values(samples, name).items()}


def bumped(page: str, prompt: float, cached: float) -> bytes:
    """The captured page with its prompt and device-cached counters set (each once in it)."""
    lines = []
    for line in page.splitlines():
        if line.startswith(PROMPT):
            line = f"{PROMPT}{prompt}"
        elif line.startswith(CACHED):
            line = f"{CACHED}{cached}"
        lines.append(line)
    return ("\n".join(lines) + "\n").encode()


async def two_polls(page: str, engine: str) -> tuple[list, list]:
    upstreams = {"vl": Upstream(PAYLOAD.encode()), "sg": Upstream(bumped(page, 112.0, 44.0))}
    app = web.Application()
    for name, upstream in upstreams.items():
        app.router.add_get(f"/{name}/metrics", upstream.handler)
    runner, url = await serve(app)
    replicas = [
        replica_for(f"{url}/vl/metrics", None, "vl"),
        replica_for(f"{url}/sg/metrics", None, "sg", engine=engine),
    ]
    settings = PoolSettings(windows=(60.0,), interval=1.0, timeout=2.0, kv_events_discovery=False)
    aggregator = Aggregator(settings, [StaticSd(replicas)])
    try:
        await aggregator.poll_once()
        first = aggregator.latest
        upstreams["sg"].body = bumped(page, 212.0, 104.0)  # 100 prompt tokens, 60 of them cached
        await asyncio.sleep(0.01)
        await aggregator.poll_once()
        return first, aggregator.latest
    finally:
        await aggregator.close()
        await runner.cleanup()


def test_an_sglang_replica_counts_in_the_pool_as_read_from_its_page(shared_fixtures):
    page = (shared_fixtures / "sglang-0.5.23" / "live-metrics.txt").read_text()
    for engine in ("vllm", "sglang"):  # the default (the page decides); the replica's engine named
        first, last = asyncio.run(two_polls(page, engine))
        assert per_replica(last, "kvcache_vllm_up") == {"vl": 1.0, "sg": 1.0}, engine
        queries = per_replica(last, "kvcache_fleet_query_tokens_total")
        hits = per_replica(last, "kvcache_fleet_hit_tokens_total")
        assert (queries["sg"], hits["sg"]) == (212.0, 104.0), engine
        assert not values(first, "kvcache_fleet_hit_ratio")  # one poll: no window yet
        # the vLLM page did not move: the pool's window is the SGLang replica's 60 of 100
        assert values(last, "kvcache_fleet_hit_ratio") == {(("window", "1m"),): 0.6}, engine


def test_a_vllm_page_on_a_replica_named_sglang_is_wrong_engine_not_misread(shared_fixtures):
    page = (shared_fixtures / "sglang-0.5.23" / "live-metrics.txt").read_text()

    async def run() -> list:
        app = web.Application()
        app.router.add_get("/vl/metrics", Upstream(PAYLOAD.encode()).handler)
        runner, url = await serve(app)
        named_sglang = replica_for(f"{url}/vl/metrics", None, "vl", engine="sglang")
        aggregator = Aggregator(
            PoolSettings(windows=(60.0,), kv_events_discovery=False), [StaticSd([named_sglang])]
        )
        try:
            await aggregator.poll_once()
            return aggregator.latest
        finally:
            await aggregator.close()
            await runner.cleanup()

    assert page  # the fixture is there; the page served is vLLM's
    samples = asyncio.run(run())
    assert list(values(samples, "kvcache_vllm_up").values()) == [0.0]
    reasons = {dict(k).get("reason") for k in values(samples, "kvcache_exporter_errors_total")}
    assert "wrong_engine" in reasons
