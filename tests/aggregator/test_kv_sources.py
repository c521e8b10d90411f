"""The aggregator asks each replica's vLLM where it publishes (/kv_event_sources), as `serve` does:
loopback replicas whose answer each test sets, a real ZMQ publisher, the simulator as a vLLM without
the route."""

from __future__ import annotations

import asyncio

import msgspec
import zmq

from kvcache_exporter.aggregator.discovery import StaticSd, parse_flag
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from kvcache_exporter.simulator.config import SimulatorConfig
from kvcache_exporter.simulator.server import start_simulator
from kvcache_exporter.tools.harness import free_port
from tests.loopback import FakeVllm


def config(endpoint: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}


def followed(aggregator: Aggregator) -> list[tuple[tuple[int, str, str], ...]]:
    """Each replica's KV-event streams as (rank, endpoint, our mode)."""
    return [
        tuple((s.rank, s.endpoint, s.mode) for s in m.replica.streams()) for m in aggregator.members.values()
    ]


async def endpoints_after(replica: FakeVllm, target: str | None = None, polls: int = 1, change=None):
    """The replica's KV-event streams in the aggregator after each of `polls` polls."""
    url = await replica.start()
    aggregator = Aggregator(
        PoolSettings(interval=0.5, kv_sources_every=0.0), [StaticSd([parse_flag(target or url, 5557)])]
    )
    seen = []
    try:
        for poll in range(polls):
            if change is not None and poll == 1:
                replica.answer = change
            await aggregator.poll_once()
            seen += followed(aggregator)
        return seen, aggregator
    finally:
        await aggregator.close()
        await replica.runner.cleanup()


def test_a_wildcard_bind_is_connected_on_the_replicas_host_and_streams():
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    try:
        seen, aggregator = asyncio.run(endpoints_after(FakeVllm({"0": config(f"tcp://*:{port}")})))
        assert seen == [((0, f"tcp://127.0.0.1:{port}", "connect"),)]
        assert pub.poll(10_000), "the aggregator never subscribed to the discovered endpoint"
    finally:
        pub.close(linger=0)
        ctx.term()
    (name,) = aggregator.kv_sources
    assert aggregator.kv_sources[name].answer.found.state == "found"


def test_every_rank_is_followed_and_a_vllm_connecting_to_another_host_is_not():
    seen, _ = asyncio.run(
        endpoints_after(FakeVllm({"0": config("tcp://[::]:5600"), "1": config("tcp://*:5601")}))
    )
    assert seen == [((0, "tcp://127.0.0.1:5600", "connect"), (1, "tcp://127.0.0.1:5601", "connect"))]
    seen, _ = asyncio.run(endpoints_after(FakeVllm({"0": config(f"tcp://192.0.2.1:{free_port()}")})))
    assert seen == [()]  # vLLM connects out to another host: only a subscriber there could bind it
    port = free_port()
    seen, _ = asyncio.run(endpoints_after(FakeVllm({"0": config(f"tcp://127.0.0.1:{port}")})))
    assert seen == [((0, f"tcp://127.0.0.1:{port}", "bind"),)]  # to the replica's own address: bound


def test_a_changed_answer_moves_the_replica_once_two_answers_agree():
    seen, aggregator = asyncio.run(
        endpoints_after(
            FakeVllm({"0": config("tcp://*:5600")}), polls=4, change={"0": config("tcp://*:5700")}
        )
    )
    assert (
        seen
        == [((0, "tcp://127.0.0.1:5600", "connect"),)] * 2 + [((0, "tcp://127.0.0.1:5700", "connect"),)] * 2
    )
    assert next(iter(aggregator.kv_sources.values())).answer.changes == 1


def test_a_named_endpoint_wins_and_is_not_asked():
    replica = FakeVllm({"0": config("tcp://*:5600")})

    async def run():
        url = await replica.start()
        await replica.runner.cleanup()
        return url

    url = asyncio.run(run())
    seen, _ = asyncio.run(endpoints_after(replica, f"{url},tcp://127.0.0.1:5999"))
    assert seen == [((0, "tcp://127.0.0.1:5999", "connect"),)] and replica.asked == 0


def test_a_vllm_without_the_route_keeps_the_default_port():
    async def run():
        simulator = await start_simulator(SimulatorConfig(port=0, schedule="none"))
        aggregator = Aggregator(PoolSettings(interval=0.5), [StaticSd([parse_flag(simulator.url, 5557)])])
        try:
            await aggregator.poll_once()
            return followed(aggregator), aggregator.latest
        finally:
            await aggregator.close()
            await simulator.stop()

    seen, samples = asyncio.run(run())
    assert seen == [((0, "tcp://127.0.0.1:5557", "connect"),)]
    assert [s.value for s in samples if s.name == "kvcache_kv_events_discovered_endpoints"] == [0.0]


def stored_batch(seq: int, *hashes: int) -> list[bytes]:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": list(hashes)}], 0])
    return [b"kv", seq.to_bytes(8, "big"), payload]


def test_every_rank_of_a_data_parallel_replica_streams_into_one_replica():
    """Rank 0 binds tcp://*:PORT (we connect), rank 1 connects out to the replica's own address (we
    bind): each its own stream and sequence, both into the one replica's residency."""
    ctx = zmq.Context()
    rank0, rank1 = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
    port0, port1 = free_port(), free_port()
    rank0.bind(f"tcp://127.0.0.1:{port0}")
    replica = FakeVllm({"0": config(f"tcp://*:{port0}"), "1": config(f"tcp://127.0.0.1:{port1}")})

    async def run():
        url = await replica.start()
        aggregator = Aggregator(
            PoolSettings(interval=0.5, kv_sources_every=0.0), [StaticSd([parse_flag(url, 5557)])]
        )
        try:
            await aggregator.poll_once()
            rank1.connect(f"tcp://127.0.0.1:{port1}")  # vLLM's side: it connects to what we bound
            (name,) = aggregator.members
            view = aggregator.fleet.replicas[name]
            for seq in range(100):  # PUB/SUB drops what is sent before the subscription arrives
                if all(view.ranks.get(r) and view.ranks[r].resident for r in (0, 1)):
                    break
                rank0.send_multipart(stored_batch(seq, 1, 2))
                rank1.send_multipart(stored_batch(seq, 2, 3))
                await asyncio.sleep(0.1)
                await aggregator.poll_once()
            return aggregator, name
        finally:
            await aggregator.close()
            await replica.runner.cleanup()

    try:
        aggregator, name = asyncio.run(run())
    finally:
        ctx.destroy(linger=0)
    view, fleet = aggregator.fleet.replicas[name], aggregator.fleet
    assert (view.ranks[0].resident, view.ranks[1].resident, view.resident) == (2, 2, 4)
    assert (view.other_replica, view.restarts, fleet.distinct, fleet.duplicates) == (0, 0, 3, 0)
    assert list(fleet.replicas) == [name]
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in aggregator.latest}
    assert samples[("kvcache_kv_events_discovered_endpoints", (("replica", name),))] == 2
    success = ("kvcache_exporter_collector_success", (("collector", "kv_events"), ("replica", name)))
    assert samples[success] == 1
    assert samples[("kvcache_fleet_resident_blocks", (("replica", name),))] == 4
