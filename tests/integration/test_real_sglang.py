"""The exporter against a REAL SGLang 0.5.23 on this CPU (the session's one server, sglang_servers.py).

`serve` is given SGLang's /metrics URL and nothing else: it tells the engine from the page, finds the
KV-event stream from /server_info, and its numbers are checked against SGLang's own counters on the
same traffic. One server (HiCache on, 256 device tokens, 512 host tokens, page 4) serves every check.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.integration.miss_tokens import causes, delta, scrape, settle, tokens
from tests.integration.sglang_servers import PAGE

# SGLang starts in 1-8 minutes on a loaded 2-core machine, inside the first test's time
pytestmark = [pytest.mark.sglang, pytest.mark.slow, pytest.mark.timeout(1500)]


def sglang_counters(server) -> dict[str, float]:
    """SGLang's own prompt and cached tokens (summed over cache_source) so far, and cached by source
    (a cache_source's series appears with its first hit: none is 0 here, SGLang's own count)."""
    out: dict[str, float] = {"prompt": 0.0, "cached": 0.0}
    for name, labels, value in scrape(server):
        if name == "sglang:prompt_tokens_total":
            out["prompt"] = out.get("prompt", 0.0) + value
        elif name == "sglang:cached_tokens_total":
            out["cached"] = out.get("cached", 0.0) + value
            key = f"cached_{labels.get('cache_source')}"
            out[key] = out.get(key, 0.0) + value
    return out


def exported(exporter, name: str, **labels: str) -> float | None:
    found = [
        v for n, got, v in scrape(exporter) if n == name and all(got.get(k) == w for k, w in labels.items())
    ]
    return sum(found) if found else None


def caught_up(exporter, server, timeout: float = 30.0) -> dict[str, float]:
    """SGLang's counters once the exporter's copy of its prompt tokens equals them (no traffic meanwhile)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        own = sglang_counters(server)
        if (
            exported(exporter, "kvcache_prefix_cache_query_tokens_total", engine_kind="sglang")
            == own["prompt"]
        ):
            return own
        time.sleep(0.5)
    pytest.fail(f"the exporter never caught up with SGLang's counters\n{exporter.log()}", pytrace=False)


def flush(server, exporter, tries: int = 10) -> None:
    """/flush_cache until SGLang publishes AllBlocksCleared (it declines while a request is in flight)."""

    def cleared() -> float:
        return exported(exporter, "kvcache_kv_events_total", type="AllBlocksCleared") or 0.0

    before = cleared()
    for _ in range(tries):
        server.flush_cache()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if cleared() > before:
                return
            time.sleep(0.3)
    pytest.fail(f"SGLang never flushed its cache\n{server.log()}", pytrace=False)


def test_real_sglang(sglang_server, start_exporter) -> None:
    rng = random.Random(30)
    server = sglang_server
    args = ("--vllm.url", server.metrics_url, "--collect.interval", "1s", "--gpu.source", "none")
    with start_exporter(*args) as exporter:
        before = caught_up(exporter, server)  # the first poll: the 1h window starts here
        assert exported(exporter, "kvcache_vllm_up", engine_kind="sglang") == 1
        assert exported(exporter, "kvcache_block_size_tokens", engine_kind="sglang") == PAGE
        assert exported(exporter, "kvcache_capacity_tokens", engine_kind="sglang") == 256
        deadline = time.monotonic() + 90  # discovery (/server_info), then the subscriber's first batch
        while not sum(causes(exporter).values()) and time.monotonic() < deadline:
            server.generate(tokens(rng, 40))
            time.sleep(1.0)
        assert exported(exporter, "kvcache_kv_events_discovered_endpoints") == 1, exporter.log()
        settle(exporter)

        # exact repeats hit: SGLang recomputes at least the last page, nothing else is a miss
        prompt = tokens(rng, 120)
        server.generate(prompt)
        first, own = settle(exporter), sglang_counters(server)
        server.generate(prompt)
        repeat = delta(settle(exporter), first)
        assert (
            sum(repeat.values()) <= PAGE and sglang_counters(server)["cached"] - own["cached"] >= 120 - PAGE
        )

        # a field in front of a shared template: prefix_diverged dominant; the template first: none
        template = tokens(rng, 160)
        for length in (3, 11, 19, 29, 7, 23):
            server.generate(tokens(rng, length) + template)
        header = settle(exporter)
        got = delta(header, first)
        assert got["prefix_diverged"] > 0.6 * sum(got.values()), got
        template2 = tokens(rng, 160)
        for length in (3, 11, 19, 29, 7, 23):
            server.generate(template2 + tokens(rng, length))
        tail = settle(exporter)
        got = delta(tail, header)
        assert got.get("prefix_diverged", 0) == 0, got

        # HiCache: pushed off the device but held on the host, a prompt is loaded back: a tier hit
        held = tokens(rng, 100)
        server.generate(held)
        for _ in range(3):
            server.generate(tokens(rng, 100))  # 300 tokens through a 256-token device pool
        hits_before = exported(exporter, "kvcache_kv_events_tier_hit_tokens_total") or 0.0
        own = sglang_counters(server)
        server.generate(held)
        reloaded = settle(exporter)
        own_after = caught_up(exporter, server)
        host_hits = own_after.get("cached_host", 0) - own.get("cached_host", 0)
        tier_hits = (exported(exporter, "kvcache_kv_events_tier_hit_tokens_total") or 0.0) - hits_before
        print(
            f"\nhost-tier hits: SGLang {host_hits:.0f}, ours {tier_hits:.0f}; misses {delta(reloaded, tail)}"
        )
        assert host_hits > 0 and tier_hits >= host_hits - PAGE, (host_hits, tier_hits)
        assert (
            exported(exporter, "kvcache_prompt_tokens_cached_by_tier_total", tier="host")
            == own_after["cached_host"]
        )

        # more prompts than both tiers hold (256 + 512 tokens): the first ones come back evicted
        many = [tokens(rng, 160) for _ in range(8)]
        for p in many * 2:
            server.generate(p)
        evicted = settle(exporter)
        got = delta(evicted, reloaded)
        assert got.get("evicted", 0) > 0.3 * sum(got.values()), got

        # /flush_cache: SGLang publishes AllBlocksCleared; what it held is then lost to a restart
        # (SGLang publishes a request's events at its scheduler's next step: a short prompt after each)
        again = tokens(rng, 120)
        server.generate(again)
        server.generate(tokens(rng, 8))
        stored = settle(exporter)
        flush(server, exporter)
        server.generate(again)
        server.generate(tokens(rng, 8))
        flushed = settle(exporter)
        got = delta(flushed, stored)
        assert got.get("restart", 0) >= 120 - 2 * PAGE, got

        # the hit ratio is SGLang's own counters' on the same traffic (never its cache_hit_rate gauge)
        after = caught_up(exporter, server)
        assert exported(exporter, "kvcache_prefix_cache_hit_tokens_total") == after["cached"]
        ours = exported(exporter, "kvcache_prefix_cache_hit_ratio", window="1h")
        theirs = (after["cached"] - before["cached"]) / (after["prompt"] - before["prompt"])
        print(f"hit ratio over the test: ours {ours:.6f}, SGLang's counters {theirs:.6f}; {dict(flushed)}")
        assert ours == pytest.approx(theirs, abs=1e-9)
        missed = {n: v for n, _, v in scrape(exporter) if n == "kvcache_kv_events_missed_batches_total"}
        assert missed == {"kvcache_kv_events_missed_batches_total": 0.0}, missed
