"""A pool of vLLM and SGLang replicas in one `aggregate`: each engine's hashes are its own (never a
block of another engine), HiCache's host copies are not GPU residency, and a replica's engine comes
from --replica or a file_sd label. The SGLang streams are the real 0.5.23 captures."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import zmq
from aiohttp import web

from kvcache_exporter.aggregator.discovery import StaticSd, parse_file_sd, parse_flag, replica_for
from kvcache_exporter.aggregator.fleet_residency import FleetResidency
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings, stream_name
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import Batch, Event
from tests.aggregator.test_replica_hostile import GOOD
from tests.conftest import SHARED_FIXTURES
from tests.loopback import serve

SGLANG = SHARED_FIXTURES / "sglang-0.5.23"


def stored(*hashes, medium=None):
    return Event("BlockStored", tuple(hashes), medium=medium)


def batch(seq, *events):
    return Batch(seq, 0.0, tuple(events))


def sglang_batches(name: str) -> list[Batch]:
    """A capture decoded as the aggregator decodes it: without token ids, the engine's rules on."""
    out = []
    for message in json.loads((SGLANG / name).read_text()):
        frames = [b"kv", message["seq"].to_bytes(8, "big"), bytes.fromhex(message["payload_hex"])]
        out.append(decode_engine_message(frames, engine="sglang"))
    return out


def test_the_same_hash_on_two_engines_is_never_shared():
    fleet = FleetResidency()
    fleet.add_replica("v", "vllm")
    fleet.add_replica("s", "sglang")
    fleet.apply("v", batch(0, stored(1, 2, 3)))
    fleet.apply("s", batch(0, stored(1, 2, 3)))
    v, s = fleet.replicas["v"], fleet.replicas["s"]
    assert (v.other_replica, s.other_replica, fleet.duplicates, fleet.distinct) == (0, 0, 0, 6)
    assert (v.resident, s.resident) == (3, 3)
    fleet.apply("s", batch(1, Event("BlockRemoved", (1,))))
    assert (v.resident, s.resident, fleet.distinct) == (3, 2, 5)  # vLLM's block 1 stays


def test_two_replicas_of_one_engine_still_share():
    fleet = FleetResidency()
    for name in ("s1", "s2"):
        fleet.add_replica(name, "sglang")
    fleet.apply("s1", batch(0, stored(7, 8)))
    fleet.apply("s2", batch(0, stored(8, 9)))
    assert (fleet.replicas["s2"].other_replica, fleet.duplicates) == (1, 1)


def test_hicache_host_copies_are_not_gpu_residency():
    """The live HiCache run: every GPU store is backed up as CPU_PINNED and the host copies later
    evicted; the pool view follows the GPU only."""
    gpu = FleetResidency()
    gpu.add_replica("s", "sglang")
    for each in sglang_batches("live-hicache-kv-frames.json"):
        gpu.apply("s", each)
        if any(e.type == "AllBlocksCleared" for e in each.events):
            break
        held = set()
        for e in (
            e for b in sglang_batches("live-hicache-kv-frames.json") if b.seq <= each.seq for e in b.events
        ):
            if e.medium == "GPU" and e.type == "BlockStored":
                held.update(e.block_hashes)
            elif e.medium == "GPU" and e.type == "BlockRemoved":
                held.difference_update(e.block_hashes)
        assert gpu.replicas["s"].resident == len(held)
    assert gpu.replicas["s"].stored == sum(
        len(e.block_hashes)
        for b in sglang_batches("live-hicache-kv-frames.json")
        for e in b.events
        if e.type == "BlockStored" and e.medium == "GPU"
    )


def test_a_replicas_engine_comes_from_the_flag_or_a_file_sd_label():
    assert parse_flag("b:30000,tcp://b:5557,sglang", None).engine == "sglang"
    assert parse_flag("a:8000", 5557).engine == "vllm"
    sd = json.dumps([{"targets": ["c:30000"], "labels": {"engine": "trtllm"}}, {"targets": ["d:8000"]}])
    assert [r.engine for r in parse_file_sd(sd, 5557)] == ["trtllm", "vllm"]
    with pytest.raises(ValueError, match="engine 'tgi'"):
        parse_flag("b:30000,tcp://b:5557,tgi", None)


def test_aggregate_on_a_mixed_pool_with_a_hostile_sglang_stream():
    """The aggregator itself: a vLLM replica and an SGLang one (its real HiCache capture, then a batch
    with a merged event whose ids disagree with its pages and an unknown medium), both storing the
    same hash values. Each bad event is counted on the SGLang replica, nothing is shared across the
    engines, host copies are not resident, the vLLM replica is untouched."""
    asyncio.run(_mixed_pool())


async def _mixed_pool() -> None:
    async def page(_request: web.Request) -> web.Response:
        return web.Response(body=GOOD)

    app = web.Application()
    app.router.add_get("/{name}/metrics", page)
    runner, url = await serve(app)
    context = zmq.Context()
    pubs = {name: context.socket(zmq.PUB) for name in ("v", "s")}
    for pub in pubs.values():
        pub.bind("tcp://127.0.0.1:*")
    endpoint = {n: p.getsockopt(zmq.LAST_ENDPOINT).decode() for n, p in pubs.items()}
    replicas = [
        replica_for(f"{url}/v/metrics", None, "v", endpoint["v"]),
        replica_for(f"{url}/s/metrics", None, "s", endpoint["s"], engine="sglang"),
    ]
    settings = PoolSettings(windows=(60.0,), interval=1.0, timeout=1.0, max_body_bytes=1 << 20)
    aggregator = Aggregator(settings, [StaticSd(replicas)])
    capture = json.loads((SGLANG / "live-hicache-kv-frames.json").read_text())
    capture = [m for m in capture if m["decoded"][1][0]["type"] != "AllBlocksCleared"]
    first_gpu = capture[0]["decoded"][1][0]["block_hashes"]
    bad = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "lora_id": None}
    bad |= {"token_ids": [5] * 9, "block_size": 4, "medium": "GPU"}
    tape = {"type": "BlockRemoved", "block_hashes": [3], "medium": "TAPE"}
    vllm_same = {"type": "BlockStored", "block_hashes": first_gpu, "token_ids": [], "block_size": 4}
    try:
        await aggregator.poll_once()  # subscribes both
        deadline = asyncio.get_running_loop().time() + 30
        sent = False
        while asyncio.get_running_loop().time() < deadline:
            if not sent and all(aggregator.events.healthy(stream_name(n, 0)) for n in pubs):
                await asyncio.sleep(0.5)  # the subscriptions reach the publishers
                for seq, m in enumerate(capture):
                    pubs["s"].send_multipart([b"kv", seq.to_bytes(8, "big"), bytes.fromhex(m["payload_hex"])])
                hostile = msgspec.msgpack.encode([1.0, [bad, tape], 0])
                pubs["s"].send_multipart([b"kv", len(capture).to_bytes(8, "big"), hostile])
                pubs["v"].send_multipart([b"kv", b"\0" * 8, msgspec.msgpack.encode([1.0, [vllm_same], 0])])
                sent = True
            await aggregator.poll_once()
            s, v = aggregator.fleet.replicas["s"], aggregator.fleet.replicas["v"]
            if sent and s.batches == len(capture) + 1 and v.batches == 1:
                break
            await asyncio.sleep(0.2)
        samples = aggregator.latest
    finally:
        await aggregator.close()
        await runner.cleanup()
        context.destroy(linger=0)
    assert (s.batches, v.batches) == (len(capture) + 1, 1)
    dropped = {
        (x.labels["replica"], x.labels["reason"]): x.value
        for x in samples
        if x.name == "kvcache_kv_events_dropped_total" and x.value
    }
    assert dropped == {("s", "invalid_block_size"): 1, ("s", "invalid_event"): 1}
    assert (v.other_replica, s.other_replica, aggregator.fleet.duplicates) == (0, 0, 0)
    assert v.resident == len(first_gpu)
    gpu = set()
    for m in capture:
        for e in m["decoded"][1]:
            if e["medium"] == "GPU":
                (gpu.update if e["type"] == "BlockStored" else gpu.difference_update)(e["block_hashes"])
    assert s.resident == len(gpu)
