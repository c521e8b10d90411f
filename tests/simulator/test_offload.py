"""The CPU offload tier (simulator/offload.py), whose events and metrics follow vLLM 0.33's
OffloadingConnector (CPU offload does not run on vLLM's CPU backend: there is no capture to compare)."""

import random

import msgspec
from prometheus_client import generate_latest

from kvcache_exporter.simulator.config import SimulatorConfig, cache_config_labels
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request
from kvcache_exporter.simulator.exposition import ExpositionState, make_registry
from kvcache_exporter.simulator.kv_events import encode_batch
from kvcache_exporter.sources.vllm_parse import parse

BLOCK_BYTES = 32 * 1024


def engine(tier_blocks: int = 64) -> Engine:
    return Engine(
        EngineConfig(
            block_size=32, num_gpu_blocks=17, offload_cpu_blocks=tier_blocks, offload_block_bytes=BLOCK_BYTES
        )
    )


def run(e: Engine, prompt: list[int], events: list[dict]) -> Request:
    now = e.pool.now + 1.0
    request = Request(f"r{len(events)}", prompt, 4, now)
    e.add_request(request)
    while e.has_work:
        result = e.step(now)
        now += result.duration
        if result.events:
            events += msgspec.msgpack.decode(encode_batch(result.events, 0, ts=1.0))[1]
    return request


def test_a_block_evicted_from_the_gpu_is_loaded_back_from_the_cpu_tier():
    rng = random.Random(1)
    e, events = engine(), []
    prompt = [rng.randrange(5, 500) for _ in range(300)]
    run(e, prompt, events)
    for _ in range(4):  # push the prompt out of the 16-block GPU pool
        run(e, [rng.randrange(5, 500) for _ in range(300)], events)
    before = len(events)
    again = run(e, prompt, events)
    assert again.num_cached_tokens == again.num_external_tokens == 288  # 9 full blocks, from the host tier
    stats = e.tier.stats
    assert stats.load_bytes == 9 * BLOCK_BYTES and stats.external_hits == 288
    # The loaded blocks are cached on the GPU again: a GPU store of blocks the CPU tier held.
    gpu_stores = [x for x in events[before:] if x["type"] == "BlockStored" and x["medium"] == "GPU"]
    assert gpu_stores and gpu_stores[0]["parent_block_hash"] is None
    cpu = [x for x in events if x["medium"] == "CPU"]
    assert {x["type"] for x in cpu} == {"BlockStored"}  # 64 blocks hold everything sent
    assert len([x for x in cpu if x["type"] == "BlockStored"]) == 5 * 9  # each distinct block stored once


def test_cpu_events_have_vllm_033s_placeholder_shape():
    """vLLM 0.33 `OffloadingEventsTracker._placeholder_stored` / `_take_removed_event`, encoded with
    msgspec omit_defaults: extra_keys, kv_cache_spec_*, locality, ownership left out."""
    rng = random.Random(2)
    e, events = engine(tier_blocks=12), []
    for _ in range(3):
        run(e, [rng.randrange(5, 500) for _ in range(300)], events)
    stored = next(x for x in events if x["medium"] == "CPU" and x["type"] == "BlockStored")
    assert stored == {
        "type": "BlockStored",
        "block_hashes": stored["block_hashes"],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
        "group_idx": 0,
    }
    assert list(stored) == list({**stored})  # key order as declared
    assert len(stored["block_hashes"]) == 1
    removed = [x for x in events if x["medium"] == "CPU" and x["type"] == "BlockRemoved"]
    assert removed and all(list(x) == ["type", "block_hashes", "medium", "group_idx"] for x in removed)
    assert len(e.tier.blocks) == 12


def test_metrics_carry_the_kv_offload_families_and_parse():
    rng = random.Random(3)
    e, events = engine(), []
    prompt = [rng.randrange(5, 500) for _ in range(300)]
    for p in (prompt, *([rng.randrange(5, 500) for _ in range(300)] for _ in range(4)), prompt):
        run(e, p, events)
    config = SimulatorConfig(engine=e.config)
    state = ExpositionState("tiny", [e], 1.0, lambda i: cache_config_labels(config, i))
    text = generate_latest(make_registry(lambda: state)).decode()
    for name in (
        "vllm:kv_offload_load_bytes_total",
        "vllm:kv_offload_store_bytes_total",
        "vllm:kv_offload_load_time_total",
        "vllm:kv_offload_store_time_total",
        "vllm:kv_offload_allocation_failure_total",
        "vllm:kv_offload_load_size_bucket",
        "vllm:kv_offload_store_size_bucket",
        "vllm:kv_offload_cpu_cache_usage_perc",
        "vllm:external_prefix_cache_hits_total",
    ):
        assert f'{name}{{engine="0",' in text, name
    assert 'source="host"} 288.0' in text and 'source="external_kv_transfer"} 288.0' in text
    snapshot = parse(text)
    assert snapshot.missing == ()
    assert snapshot.cache_configs[next(iter(snapshot.cache_configs))]["kv_offloading_size"] == str(
        64 * BLOCK_BYTES / 2**30
    )
