"""The hostile inputs `serve`'s vLLM poll is tested against (tests/sources/test_vllm_hostile.py,
test_http.py), now against the aggregator's replica poll: a real loopback upstream per replica,
one hostile and one well-behaved. The hostile replica reads down with its reason, once; its
neighbour and the pool view are untouched; nothing non-finite or negative is served; the next
good answer brings it back. And a bug in one replica's handling costs that replica's poll only."""

from __future__ import annotations

import asyncio
import gzip
import math

import pytest
from aiohttp import web

from kvcache_exporter.aggregator import pool
from kvcache_exporter.aggregator.discovery import StaticSd, replica_for
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from tests.loopback import serve
from tests.sources.test_http import Upstream
from tests.sources.test_vllm_hostile import PAYLOAD, with_value

GOOD = PAYLOAD.encode()

VALUES = {
    f"{name} {value}": with_value(name, value).encode()
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:generation_tokens_total", "vllm:e2e_request_latency_seconds_bucket")
    for value in ("+Inf", "-Inf", "NaN", "-1000")
}  # fmt: skip
VALUES["bucket without le"] = PAYLOAD.replace('engine="0",le="0.001",', 'engine="0",', 1).encode()
VALUES["bucket bound not a number"] = PAYLOAD.replace('le="0.001"', 'le="fast"', 1).encode()

GZIP = {"Content-Encoding": "gzip"}
DELIVERIES = {
    "gzip bomb": (Upstream(gzip.compress(b"\0" * (64 << 20)), 4096, headers=GZIP), "body_too_large"),
    "corrupt gzip": (Upstream(b"\x1f\x8b\x08\x00garbage-not-deflate", headers=GZIP), "parse_error"),
    "a drip": (Upstream(b"vllm:x 1\n" * 50, chunk=1, pause=0.2), "timeout"),
    "an endless body": (Upstream(endless=True), "body_too_large"),
    "cut mid-body": (Upstream(b"vllm:x 1\n" * 100, content_length=100_000, cut=True), "truncated_body"),
    "bad bytes": (Upstream(b"vllm:x 1\n\xff\xfe\n"), "parse_error"),
}  # fmt: skip


async def poll(upstreams: dict[str, Upstream], times: int = 1, between=None) -> list:
    app = web.Application()
    for name, upstream in upstreams.items():
        app.router.add_get(f"/{name}/metrics", upstream.handler)
    runner, url = await serve(app)
    replicas = [replica_for(f"{url}/{name}/metrics", None, name) for name in upstreams]
    settings = PoolSettings(windows=(60.0,), interval=1.0, timeout=1.0, max_body_bytes=1 << 20)
    aggregator = Aggregator(settings, [StaticSd(replicas)])
    try:
        for n in range(times):
            if n and between is not None:
                between(upstreams)
            await aggregator.poll_once()
    finally:
        await aggregator.close()
        await runner.cleanup()
    return aggregator.latest


def by_key(samples, name):
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


def assert_contained(samples, reason):
    up = by_key(samples, "kvcache_vllm_up")
    assert up == {(("replica", "bad"),): 0.0, (("replica", "good"),): 1.0}
    errors = by_key(samples, "kvcache_exporter_errors_total")
    assert errors[(("collector", "vllm"), ("reason", reason), ("replica", "bad"))] == 1
    assert not [k for k in errors if ("replica", "good") in k]
    assert all(math.isfinite(s.value) and s.value >= 0 for s in samples)
    assert [k for k in by_key(samples, "kvcache_fleet_query_tokens_total")] == [(("replica", "good"),)]


@pytest.mark.parametrize("case", VALUES)
def test_broken_values_in_a_replicas_body(case):
    samples = asyncio.run(poll({"good": Upstream(GOOD), "bad": Upstream(VALUES[case])}))
    assert_contained(samples, "parse_error")


@pytest.mark.parametrize("case", DELIVERIES)
def test_hostile_deliveries_of_a_replicas_body(case):
    upstream, reason = DELIVERIES[case]
    samples = asyncio.run(poll({"good": Upstream(GOOD), "bad": upstream}))
    assert_contained(samples, reason)


def test_a_hostile_replica_comes_back_with_its_next_good_body():
    def heal(upstreams):
        upstreams["bad"].body = GOOD

    samples = asyncio.run(
        poll({"good": Upstream(GOOD), "bad": Upstream(VALUES["bucket without le"])}, 2, heal)
    )
    assert set(by_key(samples, "kvcache_vllm_up").values()) == {1.0}
    errors = by_key(samples, "kvcache_exporter_errors_total")
    assert (
        errors[(("collector", "vllm"), ("reason", "parse_error"), ("replica", "bad"))] == 1
    )  # counted, kept


def test_a_bug_handling_one_replica_costs_that_replica_only(monkeypatch):
    """Before, one replica's unexpected exception failed the whole poll (issue 19)."""
    real = pool.fleet_pool.replica_counters

    def broken(snapshot):
        if broken.calls == 0:
            broken.calls += 1
            raise ZeroDivisionError("a bug")
        return real(snapshot)

    broken.calls = 0
    monkeypatch.setattr(pool.fleet_pool, "replica_counters", broken)
    samples = asyncio.run(poll({"bad": Upstream(GOOD), "good": Upstream(GOOD)}))
    up = by_key(samples, "kvcache_vllm_up")
    assert sorted(up.values()) == [0.0, 1.0]
    errors = by_key(samples, "kvcache_exporter_errors_total")
    assert (
        sum(v for k, v in errors.items() if ("reason", "internal_error") in k and ("collector", "vllm") in k)
        == 1
    )
    assert by_key(samples, "kvcache_fleet_replicas")[()] == 2
