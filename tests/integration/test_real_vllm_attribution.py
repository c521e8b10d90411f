"""Miss attribution against the REAL vLLM 0.32 CPU server (the session's one start, see conftest.py).

The exporter binds the endpoint vLLM's PUB connects to. Three workloads, each checked on the
exporter's `kvcache_prefix_cache_miss_tokens_total{cause}` deltas:
a shared template behind a varying-length front field (prefix_diverged), four long prompts cycled
through a 64-block cache (evicted), and a prompt sent again after vLLM's /reset_prefix_cache
(AllBlocksCleared: restart), then a real restart of the server (a new publisher, seq from 0) and a
prompt known from before it (restart). Coverage is checked against vLLM's own /metrics.
"""

from __future__ import annotations

import random

import pytest

from tests.integration.miss_tokens import (
    computed,
    delta,
    reset_prefix_cache,
    scrape,
    send,
    serve_args,
    settle,
    tokens,
    warm_up,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32  # conftest.BLOCK_SIZE: the tiny model's CPU build needs multiples of 32


def test_causes_and_coverage_on_real_vllm(vllm_server, start_exporter) -> None:
    rng = random.Random(10)
    with start_exporter(*serve_args(vllm_server)) as exporter:
        warm_up(exporter, vllm_server, rng, 4 * BLOCK)
        start, start_computed = settle(exporter), computed(vllm_server)

        template = tokens(rng, 600)  # a shared template behind a front field of 3 to 29 tokens
        for length in (3, 11, 19, 29, 7, 23, 15, 5):
            send(vllm_server, tokens(rng, length) + template)
        diverged = settle(exporter)
        got = delta(diverged, start)
        assert got["prefix_diverged"] > 0.6 * sum(got.values()), got

        long_prompts = [tokens(rng, 900) for _ in range(4)]  # 4 x 28 blocks through a 64-block cache
        for prompt in long_prompts * 2:
            send(vllm_server, prompt)
        evicted = settle(exporter)
        got = delta(evicted, diverged)
        assert got["evicted"] > 0.4 * sum(got.values()) and got["evicted"] >= got["prefix_diverged"], got

        again = tokens(rng, 320)
        send(vllm_server, again)
        reset_prefix_cache(vllm_server)  # vLLM emits AllBlocksCleared
        send(vllm_server, again)  # its 10 blocks were lost with the cache, not evicted
        restarted = settle(exporter)
        got = delta(restarted, evicted)
        assert got["restart"] >= 9 * BLOCK, got

        attributed = sum(restarted.values()) - sum(start.values())
        vllm_computed = computed(vllm_server) - start_computed
        print(f"\nattributed {attributed:.0f} of {vllm_computed:.0f} computed prompt tokens: {restarted}")
        assert abs(attributed / vllm_computed - 1) < 0.05  # long prompts: the unstored tails are ~2%
        events = {n: v for n, labels, v in scrape(exporter) if n == "kvcache_kv_events_missed_batches_total"}
        assert events == {"kvcache_kv_events_missed_batches_total": 0.0}

        # A real restart: the new process publishes from seq 0 with an empty cache.
        print(f"vLLM restarted in {vllm_server.restart():.1f} s")
        for prompt in (again, long_prompts[3], long_prompts[2]):  # resident when the old server stopped
            send(vllm_server, prompt)
            after = settle(exporter)
            if delta(after, restarted).get("restart", 0) > 0:
                break  # (a first batch lost before the PUB reconnected would leave its blocks cached)
        got = delta(after, restarted)
        assert got["restart"] >= 9 * BLOCK and got.get("evicted", 0) == 0, got
        assert {
            n: v for n, _, v in scrape(exporter) if n == "kvcache_kv_events_missed_batches_total"
        } == events
