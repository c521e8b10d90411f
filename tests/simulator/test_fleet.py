"""The simulator as a pool: replicas behind one gateway, over loopback HTTP."""

import asyncio
import json

import aiohttp
import pytest

from kvcache_exporter.simulator import EngineConfig, LatencyModel, SimulatorConfig
from kvcache_exporter.simulator.fleet import SimulatorFleet, route

FAST = LatencyModel(base_s=0.002, per_prefill_token_s=0.00001, per_decode_seq_s=0.0001)


def config(**overrides) -> SimulatorConfig:
    base = {
        "engine": EngineConfig(block_size=16, num_gpu_blocks=256, max_model_len=2048, latency=FAST),
        "schedule": "none",
        "speed": 20.0,
    }
    return SimulatorConfig(**{**base, **overrides})


def queries(fleet: SimulatorFleet) -> list[float]:
    return [r.runtime.engines[0].stats.prefix_cache_queries for r in fleet.replicas]


def test_routing_rules():
    assert [route("round-robin", 3, "s", turn) for turn in range(4)] == [0, 1, 2, 0]
    assert len({route("session", 3, "chat-7", turn) for turn in range(5)}) == 1
    assert route("session", 3, "", 4) == 1  # no session: round-robin


@pytest.mark.timeout(30)
@pytest.mark.parametrize("routing", ["round-robin", "session"])
def test_the_gateway_routes_and_proxies(tmp_path, routing):
    async def body():
        fleet = await SimulatorFleet(config(), 3, routing, str(tmp_path / "sd.json")).start()
        try:
            async with aiohttp.ClientSession(base_url=fleet.url) as http:
                for _ in range(6):
                    payload = {"prompt": list(range(5, 69)), "max_tokens": 2, "user": "alice"}
                    async with http.post("/v1/completions", json=payload) as r:
                        assert r.status == 200
                        assert (await r.json())["usage"]["prompt_tokens"] == 64
            return queries(fleet), json.loads((tmp_path / "sd.json").read_text())
        finally:
            await fleet.stop()

    served, sd = asyncio.run(body())
    if routing == "round-robin":
        assert served == [128.0] * 3
    else:  # every request of alice on the one replica her session hashes to
        assert served[route("session", 3, "alice", 0)] == 384 and sum(served) == 384
    assert [g["labels"]["replica"] for g in sd] == ["replica-0", "replica-1", "replica-2"]
    assert len({g["labels"]["kv_events_endpoint"] for g in sd}) == 3
    assert all(g["targets"][0].startswith("127.0.0.1:") for g in sd)


@pytest.mark.timeout(30)
def test_built_in_chat_traffic_reaches_every_replica_and_a_restart_rewrites_file_sd(tmp_path):
    async def body():
        cfg = config(schedule="chat", rate=200.0, concurrency=8)
        fleet = await SimulatorFleet(cfg, 2, "round-robin", str(tmp_path / "sd.json")).start()
        try:
            await asyncio.sleep(1.0)
            before = json.loads((tmp_path / "sd.json").read_text())
            await fleet.restart(1)
            after = json.loads((tmp_path / "sd.json").read_text())
            return queries(fleet), before, after, fleet.replicas[1].runtime.publishers[0].seq
        finally:
            await fleet.stop()

    served, before, after, seq_after_restart = asyncio.run(body())
    assert served[0] > 0  # replica 1 was just restarted: its counters are back near zero
    assert before[0] == after[0] and before[1]["targets"] == after[1]["targets"]
    assert before[1]["labels"]["kv_events_endpoint"] != after[1]["labels"]["kv_events_endpoint"]
    assert seq_after_restart < 5
