"""What the real-vLLM miss-attribution tests share: the exporter's miss tokens by cause, what vLLM's
own counters say it computed, prompts sent as token ids, and waiting for the causes to settle."""

from __future__ import annotations

import random
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families


def scrape(process, path: str = "/metrics") -> list[tuple[str, dict[str, str], float]]:
    status, text = process.get(path)
    assert status == 200, text[:500]
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def causes(exporter, engine: str | None = None) -> dict[str, float]:
    """kvcache_prefix_cache_miss_tokens_total by cause, of one engine (None: a single-engine server)."""
    return {
        labels["cause"]: value
        for name, labels, value in scrape(exporter)
        if name == "kvcache_prefix_cache_miss_tokens_total" and labels.get("engine") == engine
    }


def prefix_counters(server, engine: str = "0") -> tuple[float, float]:
    """vLLM's own (prefix_cache_hits, prefix_cache_queries) on one engine so far."""
    values = {
        name: value
        for name, labels, value in scrape(server)
        if name.startswith("vllm:prefix_cache_") and labels.get("engine") == engine
    }
    return values["vllm:prefix_cache_hits_total"], values["vllm:prefix_cache_queries_total"]


def computed(server, engine: str = "0") -> float:
    """What vLLM computed on one engine so far: prefix_cache_queries - prefix_cache_hits."""
    hits, queries = prefix_counters(server, engine)
    return queries - hits


def settle_engines(exporter, engines=(None,), timeout: float = 20.0) -> dict:
    """Every engine's causes once they stop moving (events arrive within a step; polls every 1 s)."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = {engine: causes(exporter, engine) for engine in engines}
        if all(now.values()) and now == last:
            return now
        last = now
    pytest.fail(f"miss tokens kept moving or never appeared: {last}\n{exporter.log()}", pytrace=False)


def settle(exporter, timeout: float = 20.0) -> dict[str, float]:
    """A single-engine server's causes once they stop moving."""
    return settle_engines(exporter, (None,), timeout)[None]


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {cause: after.get(cause, 0.0) - before.get(cause, 0.0) for cause in after}


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(5, 500) for _ in range(n)]


def send(server, prompt: list[int], model: str = "tiny", headers=None, **extra) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, **extra}
    return server.post_json("/v1/completions", body, headers)


def serve_args(server, *more: str) -> tuple[str, ...]:
    """`serve` binding the endpoint the server's PUB connects to, polling every second."""
    return (
        "--vllm.url", server.metrics_url, "--collect.interval", "1s", "--gpu.source", "none",
        "--kv-events.endpoint", server.kv_events_endpoint, "--kv-events.mode", "bind",
        "--kv-events.topic", "kv", *more,
    )  # fmt: skip


def warm_up(exporter, server, rng, length: int, engines=(None,), route=lambda engine: None) -> None:
    """vLLM's PUB reconnects to the fresh bind in the background: send prompts of `length` tokens
    (to each engine, by `route`'s headers) until every stream shows miss tokens."""
    deadline = time.monotonic() + 60
    while not all(sum(causes(exporter, e).values()) for e in engines) and time.monotonic() < deadline:
        for engine in engines:
            send(server, tokens(rng, length), headers=route(engine))
        time.sleep(1.0)


def reset_prefix_cache(server) -> None:
    reset = urllib.request.Request(server.base_url + "/reset_prefix_cache", data=b"", method="POST")
    with urllib.request.urlopen(reset, timeout=60) as answer:
        assert answer.status == 200  # vLLM emits AllBlocksCleared (VLLM_SERVER_DEV_MODE=1)
