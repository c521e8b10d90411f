"""Issue 33's hostile KV events sent to a real `serve` over real ZMQ (items 0, 2, 3): a block size the
event contradicts, one bad event in a batch of 200, control characters in a session id. Each bad
event is refused and counted, its batch kept, and no counter or label takes the poison."""

from __future__ import annotations

import json
import time

import msgspec
import pytest
import zmq

from kvcache_exporter.tools.harness import free_port, wait_showing
from tests.conftest import SHARED_FIXTURES

from .test_kv_events_heavy_processes import samples, subscribed, xpub


def stored(block_hash: int, block_size: int = 16, **fields) -> dict:
    tokens = [block_hash % 1000] * 16  # 16 token ids per block, whatever block_size says
    return {
        "type": "BlockStored",
        "block_hashes": [block_hash],
        "token_ids": tokens,
        "block_size": block_size,
    } | fields


def scrape_until(url: str, done, seconds: float = 60.0) -> str:
    import urllib.request

    deadline, text = time.monotonic() + seconds, ""
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        if done(text):
            return text
        time.sleep(0.3)
    return text


def value(text: str, name: str, **labels: str) -> float:
    return sum(v for got, v in samples(text, name) if labels.items() <= got.items())


@pytest.mark.timeout(300)
def test_serve_refuses_each_poisoned_event_and_keeps_its_batch(services):
    simulator = services.simulator("--rate", "5")
    kv_port = free_port()
    exporter = services.exporter(
        "--vllm.url", f"http://127.0.0.1:{simulator.port}/metrics", "--gpu.source", "none",
        "--collect.interval", "0.5s", "--kv-events.endpoint", f"tcp://127.0.0.1:{kv_port}",
    )  # fmt: skip
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    wait_showing(url, "kvcache_vllm_up 1.0")
    huge = (1 << 64) - 1
    batches = [
        [stored(1, huge), stored(2, huge)],  # the batch, three times: 7.4e19 stored tokens before
        [stored(3, huge), stored(4, huge)],
        [stored(5, huge), stored(6, huge)],
        [stored(7, 1_000_000)],  # 1e6 cold tokens and a hit unit of 1e6 before
        [stored(100 + i, group_idx=-1 if i == 100 else 0) for i in range(200)],  # 199 kept (0 before)
        [stored(400, group_idx=0, session_id="s\x00e\x1b[31m")],  # NUL and ESC reached the label raw before
    ]
    ctx = zmq.Context()
    pub = xpub(ctx)
    try:
        pub.connect(f"tcp://127.0.0.1:{kv_port}")
        subscribed(pub)
        for seq, events in enumerate(batches):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, events, 0])])
        text = scrape_until(url, lambda t: value(t, "kvcache_kv_events_batches_total") >= len(batches))
    finally:
        pub.close()
        ctx.term()
    assert value(text, "kvcache_kv_events_batches_total") == len(batches)  # no batch lost to its bad event
    assert value(text, "kvcache_kv_events_dropped_total", reason="invalid_block_size") == 7
    assert value(text, "kvcache_kv_events_dropped_total", reason="invalid_event") == 1
    assert value(text, "kvcache_kv_events_dropped_total", reason="parse_error") == 0
    assert value(text, "kvcache_kv_events_cached_blocks") == 200  # 199 + the session's block
    stored_tokens = value(text, "kvcache_kv_events_stored_tokens_total")
    assert stored_tokens == 200 * 16  # the valid blocks' tokens, not 7.4e19
    assert value(text, "kvcache_kv_events_decode_tokens_total") < 1e6
    assert value(text, "kvcache_kv_events_hit_unit_tokens") == 16
    assert "\x00" not in text and "\x1b" not in text
    assert value(text, "kvcache_kv_events_session_tokens_total", session="s\ufffde\ufffd[31m") == 16


@pytest.mark.timeout(300)
def test_serve_reads_an_sglang_stream_by_sglangs_rules(services):
    """`--kv-events.engine sglang`: the real HiCache capture (GPU stores, CPU_PINNED backups, a
    load-back) with hostile events among them: a merged event whose ids and pages disagree, pages of
    0 and 10^9 tokens, an unknown medium, each refused and counted, every batch kept; the load-back
    is a tier hit on CPU_PINNED (28 tokens, SGLang's own load_back_tokens_total)."""
    simulator = services.simulator("--rate", "5")
    kv_port = free_port()
    exporter = services.exporter(
        "--vllm.url", f"http://127.0.0.1:{simulator.port}/metrics", "--gpu.source", "none",
        "--collect.interval", "0.5s", "--kv-events.endpoint", f"tcp://127.0.0.1:{kv_port}",
        "--kv-events.engine", "sglang",
    )  # fmt: skip
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    wait_showing(url, "kvcache_vllm_up 1.0")
    capture = json.loads((SHARED_FIXTURES / "sglang-0.5.23" / "live-hicache-kv-frames.json").read_text())
    real = [
        bytes.fromhex(m["payload_hex"]) for m in capture if m["decoded"][1][0]["type"] != "AllBlocksCleared"
    ]

    def page(h: int, size: int = 4, ids: int = 4, medium: str = "GPU") -> dict:
        event = {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None}
        return event | {"token_ids": [7] * ids, "block_size": size, "lora_id": None, "medium": medium}

    hostile = [
        page(900, ids=5),
        page(901, size=0),
        page(902, size=10**9),
        page(903, medium="TAPE"),
        page(904),
    ]
    ctx = zmq.Context()
    pub = xpub(ctx)
    try:
        pub.connect(f"tcp://127.0.0.1:{kv_port}")
        subscribed(pub)
        payloads = [*real, msgspec.msgpack.encode([1.0, hostile, 0])]
        for seq, payload in enumerate(payloads):
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])
        text = scrape_until(url, lambda t: value(t, "kvcache_kv_events_batches_total") >= len(payloads))
    finally:
        pub.close()
        ctx.term()
    assert value(text, "kvcache_kv_events_batches_total") == len(payloads)
    assert value(text, "kvcache_kv_events_dropped_total", reason="invalid_block_size") == 3
    assert value(text, "kvcache_kv_events_dropped_total", reason="invalid_event") == 1
    assert value(text, "kvcache_kv_events_tier_hit_tokens_total", medium="CPU_PINNED") == 28
