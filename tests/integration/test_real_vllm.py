"""The exporter against a REAL vLLM 0.32 CPU server (one start per session, see conftest.py).

The workload shares a ~300-token prefix across 40 prompts (plus 10 unrelated ones), so vLLM's
prefix cache really hits. The exporter's numbers are compared with what vLLM's own /metrics says,
read directly before and after the workload, and with the real KV-event stream as it went by.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.tools.harness import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

WORDS = [
    "the", "cache", "prefix", "block", "token", "metric", "server", "request", "model", "vllm",
    "prometheus", "exporter", "latency", "queue", "hit", "miss", "system", "user", "prompt", "answer",
]  # fmt: skip
SHARED_REQUESTS = 40
UNRELATED_REQUESTS = 10
MAX_TOKENS = 8
LABELS = {"model_name": "tiny", "engine": "0"}
Samples = list[tuple[str, dict[str, str], float]]


# --- reading Prometheus text ------------------------------------------------------------


def select(samples: Samples, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
    return [
        (lbl, v)
        for n, lbl, v in samples
        if n == name and all(lbl.get(k) == want for k, want in labels.items())
    ]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the matching samples; a missing metric is a failure, not a zero."""
    found = select(samples, name, **labels)
    assert found, f"no sample {name}{labels or ''} in the scrape"
    return sum(v for _, v in found)


def scrape(target) -> Samples:
    status, body = target.get("/metrics")
    assert status == 200, f"GET {target.base_url}/metrics -> {status}: {body[:500]}"
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(body)
        for s in family.samples
    ]


def vllm_counters(server) -> dict[str, float]:
    s = scrape(server)
    return {
        "hits": total(s, "vllm:prefix_cache_hits_total"),
        "queries": total(s, "vllm:prefix_cache_queries_total"),
        "requests": total(s, "vllm:request_success_total"),
    }


def exporter_counters(exporter) -> tuple[dict[str, float], Samples]:
    s = scrape(exporter)
    counters = {
        "hits": sum(v for _, v in select(s, "kvcache_prefix_cache_hit_tokens_total", **LABELS)),
        "queries": sum(v for _, v in select(s, "kvcache_prefix_cache_query_tokens_total", **LABELS)),
    }
    return counters, s


def wait_for(what: Callable[[], str], check: Callable[[], bool], timeout: float, log: Callable[[], str]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    pytest.fail(f"timed out after {timeout:.0f} s waiting for {what()}\n--- log ---\n{log()}", pytrace=False)


def wait_exporter_caught_up(exporter, want: dict[str, float]) -> Samples:
    """Poll the exporter until its copied counters equal vLLM's (it polls vLLM every second)."""
    last: dict = {}

    def caught_up() -> bool:
        last["counters"], last["samples"] = exporter_counters(exporter)
        return all(last["counters"][k] == want[k] for k in ("hits", "queries"))

    wait_for(
        lambda: f"the exporter's counters to reach vLLM's {want} (last seen: {last.get('counters')})",
        caught_up,
        20,
        exporter.log,
    )
    return last["samples"]


def wait_vllm_counted(server, before: dict[str, float], requests: int) -> dict[str, float]:
    """vLLM's counters move as each output is processed; wait until all requests are counted."""
    wait_for(
        lambda: f"vLLM to count {requests} more requests than {before}",
        lambda: vllm_counters(server)["requests"] - before["requests"] == requests,
        10,
        server.log,
    )
    return vllm_counters(server)


# --- the workload ---------------------------------------------------------------------------


def workload(seed: int) -> list[str]:
    """40 prompts sharing a 300-token prefix (each word is one token of the tiny tokenizer), 10 unrelated."""
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(300))
    tails = [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(SHARED_REQUESTS)]
    prompts = [f"{shared} question {i}: {tail}" for i, tail in enumerate(tails)]
    prompts += [" ".join(rng.choice(WORDS) for _ in range(80)) for _ in range(UNRELATED_REQUESTS)]
    rng.shuffle(prompts)
    return prompts


def complete(server, prompt: str) -> dict:
    body = server.post_json(
        "/v1/completions",
        {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    return body["usage"]


# --- the tests ------------------------------------------------------------------------------


def test_exporter_matches_real_vllm(vllm_server, start_exporter) -> None:
    t0 = time.monotonic()
    before = vllm_counters(vllm_server)
    [(config_labels, _)] = select(scrape(vllm_server), "vllm:cache_config_info")
    num_gpu_blocks = float(config_labels["num_gpu_blocks"])
    assert num_gpu_blocks > 0

    serve_args = ("--vllm.url", vllm_server.metrics_url, "--collect.interval", "1s", "--gpu.source", "none")
    with start_exporter(*serve_args) as exporter:
        exporter_started = time.monotonic()
        wait_exporter_caught_up(exporter, before)
        exp_before, _ = exporter_counters(exporter)

        t_workload = time.monotonic()
        usages = [complete(vllm_server, p) for p in workload(seed=42)]
        t_workload = time.monotonic() - t_workload
        after = wait_vllm_counted(vllm_server, before, len(usages))
        samples = wait_exporter_caught_up(exporter, after)
        exp_after, _ = exporter_counters(exporter)
        window_span = time.monotonic() - exporter_started
        ready_status, ready_body = exporter.get("/readyz")

    # The workload itself: it ran, and the shared prefix really hit vLLM's prefix cache.
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
    shared_prompt_tokens = sorted(u["prompt_tokens"] for u in usages)[-SHARED_REQUESTS:]
    assert min(shared_prompt_tokens) > 9 * 32, shared_prompt_tokens
    d_hits = after["hits"] - before["hits"]
    d_queries = after["queries"] - before["queries"]
    # 39 repeats of a >= 9-block shared prefix: at least 39 x 9 x 32 tokens hit.
    assert d_hits >= (SHARED_REQUESTS - 1) * 9 * 32, (d_hits, d_queries)
    assert d_queries > d_hits

    # (a) the exporter's counters moved exactly like vLLM's, and its 1m hit ratio is their ratio.
    assert exp_after["hits"] - exp_before["hits"] == d_hits
    assert exp_after["queries"] - exp_before["queries"] == d_queries
    assert window_span < 55, f"the 1m window no longer covers the whole run ({window_span:.0f} s)"
    ratio = select(samples, "kvcache_prefix_cache_hit_ratio", window="1m", **LABELS)
    assert len(ratio) == 1, select(samples, "kvcache_prefix_cache_hit_ratio")
    assert ratio[0][1] == pytest.approx(d_hits / d_queries, rel=1e-9), (ratio, d_hits, d_queries)

    # (b) capacity is vLLM's num_gpu_blocks.
    assert total(samples, "kvcache_blocks_capacity", **LABELS) == num_gpu_blocks

    # (c) upstream health and schema detection.
    assert total(samples, "kvcache_vllm_up") == 1
    schema = select(samples, "kvcache_vllm_schema_info")
    assert [(lbl["schema"], v) for lbl, v in schema] == [("v1", 1.0)], schema

    # (d) ready.
    assert ready_status == 200, f"/readyz -> {ready_status}: {ready_body[:300]}"

    print(
        f"\nworkload: {len(usages)} requests in {t_workload:.1f} s; "
        f"vLLM hits {d_hits:.0f} / queries {d_queries:.0f} = {d_hits / d_queries:.3f}; "
        f"test body {time.monotonic() - t0:.1f} s"
    )


class KvEventTap:
    """Binds where vLLM's PUB socket connects and re-publishes every message verbatim to the exporter's
    bound SUB socket, counting what it forwards: the ground truth for the exporter's event counters.
    It forwards only once the exporter has subscribed (an XPUB sees the subscription), so nothing the
    tap counts can be lost to ZMQ's slow-joiner drop."""

    def __init__(self, vllm_endpoint: str, exporter_endpoint: str):
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.bind(vllm_endpoint)
        self._pub = self._ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.connect(exporter_endpoint)
        self.subscribed = threading.Event()
        self.batches = 0
        self.events: Counter[str] = Counter()
        self.blocks: set[int | bytes] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._pub, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._pub in ready and self._pub.recv()[:1] == b"\x01":  # a subscribe message
                self.subscribed.set()
            if self._sub in ready:
                frames = self._sub.recv_multipart()
                if self.subscribed.is_set():
                    self._pub.send_multipart(frames)
                    self._count(frames[-1])

    def _count(self, payload: bytes) -> None:
        _ts, events, *_ = msgspec.msgpack.decode(payload)
        with self._lock:
            self.batches += 1
            for event in events:
                kind = event["type"] if isinstance(event, dict) else event[0]
                self.events[kind] += 1
                hashes = event.get("block_hashes", []) if isinstance(event, dict) else []
                if kind == "BlockStored":
                    self.blocks.update(hashes)
                elif kind == "BlockRemoved":
                    self.blocks.difference_update(hashes)
                elif kind == "AllBlocksCleared":
                    self.blocks.clear()

    def snapshot(self) -> tuple[int, Counter[str], int]:
        with self._lock:
            return self.batches, Counter(self.events), len(self.blocks)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sub.close()
        self._pub.close()
        self._ctx.term()


def exporter_event_counters(exporter) -> dict[str, float]:
    s = scrape(exporter)
    out = {
        "batches": total(s, "kvcache_kv_events_batches_total"),
        "missed": total(s, "kvcache_kv_events_missed_batches_total"),
        "cached_blocks": total(s, "kvcache_kv_events_cached_blocks"),
    }
    for lbl, v in select(s, "kvcache_kv_events_total"):
        out[lbl["type"]] = v
    return out


def test_exporter_ingests_real_kv_event_stream(vllm_server, start_exporter) -> None:
    """vLLM's real ZMQ stream, relayed byte for byte through a counting tap into the exporter."""
    exporter_kv = f"tcp://127.0.0.1:{free_port()}"  # the exporter's bound SUB socket
    serve_args = (
        "--vllm.url", vllm_server.metrics_url, "--collect.interval", "1s", "--gpu.source", "none",
        "--kv-events.endpoint", exporter_kv, "--kv-events.mode", "bind", "--kv-events.topic", "kv",
    )  # fmt: skip
    with start_exporter(*serve_args) as exporter:
        tap = KvEventTap(vllm_server.kv_events_endpoint, exporter_kv)
        try:
            wait_for(
                lambda: f"the exporter to bind and subscribe at --kv-events.endpoint {exporter_kv}",
                tap.subscribed.is_set,
                10,
                exporter.log,
            )
            # vLLM's PUB reconnects to the tap's fresh bind in the background; probe until a batch flows.
            rng = random.Random(7)
            probes = 0

            def probe() -> bool:
                nonlocal probes
                probes += 1
                complete(vllm_server, " ".join(rng.choice(WORDS) for _ in range(40)))
                return tap.snapshot()[0] > 0

            wait_for(lambda: "a KV-event batch from vLLM", probe, 30, vllm_server.log)

            before = vllm_counters(vllm_server)
            prompts = workload(seed=1234)  # a different prefix from the other test: new blocks get stored
            for prompt in prompts:
                complete(vllm_server, prompt)
            wait_vllm_counted(vllm_server, before, len(prompts))
            time.sleep(0.5)  # the engine publishes a step's events right after the step
            want_batches, want_events, want_blocks = tap.snapshot()
            got: dict[str, float] = {}

            def exporter_has_all() -> bool:
                got.update(exporter_event_counters(exporter))
                return got["batches"] >= want_batches

            wait_for(
                lambda: f"the exporter to count {want_batches} batches (has {got})",
                exporter_has_all,
                10,
                exporter.log,
            )
        finally:
            tap.close()

    assert want_events["BlockStored"] > 0 and want_events["BlockRemoved"] > 0, want_events
    assert got["batches"] == want_batches
    assert got["missed"] == 0
    for kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        assert got.get(kind, 0) == want_events[kind], (kind, got, want_events)
    assert got["cached_blocks"] == want_blocks
    print(f"\nKV events via tap after {probes} probe(s): {want_batches} batches, {dict(want_events)}")
