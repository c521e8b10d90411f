"""The aggregator asks each replica's vLLM where it publishes (/kv_event_sources), as `serve` does:
loopback replicas whose answer each test sets, a real ZMQ publisher, the simulator as a vLLM without
the route."""

from __future__ import annotations

import asyncio

import zmq

from kvcache_exporter.aggregator.discovery import StaticSd, parse_flag
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from kvcache_exporter.simulator.config import SimulatorConfig
from kvcache_exporter.simulator.server import start_simulator
from kvcache_exporter.tools.harness import free_port
from tests.loopback import FakeVllm


def config(endpoint: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}


async def endpoints_after(replica: FakeVllm, target: str | None = None, polls: int = 1, change=None):
    """The replica's KV-event endpoint in the aggregator after each of `polls` polls."""
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
            seen += [m.replica.kv_events_endpoint for m in aggregator.members.values()]
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
        assert seen == [f"tcp://127.0.0.1:{port}"]
        assert pub.poll(10_000), "the aggregator never subscribed to the discovered endpoint"
    finally:
        pub.close(linger=0)
        ctx.term()
    (name,) = aggregator.kv_sources
    assert aggregator.kv_sources[name].answer.found.state == "found"


def test_another_host_is_replaced_and_a_bind_vllm_cannot_be_followed():
    seen, _ = asyncio.run(
        endpoints_after(FakeVllm({"0": config("tcp://[::]:5600"), "1": config("tcp://*:5601")}))
    )
    assert seen == ["tcp://127.0.0.1:5600"]  # rank 0: the fleet view is one stream a replica
    seen, _ = asyncio.run(endpoints_after(FakeVllm({"0": config(f"tcp://192.0.2.1:{free_port()}")})))
    assert seen == [None]  # vLLM connects out to an address: only a subscriber there could bind it


def test_a_changed_answer_moves_the_replica_once_two_answers_agree():
    seen, aggregator = asyncio.run(
        endpoints_after(
            FakeVllm({"0": config("tcp://*:5600")}), polls=4, change={"0": config("tcp://*:5700")}
        )
    )
    assert seen == ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5600"] + ["tcp://127.0.0.1:5700"] * 2
    assert next(iter(aggregator.kv_sources.values())).answer.changes == 1


def test_a_named_endpoint_wins_and_is_not_asked():
    replica = FakeVllm({"0": config("tcp://*:5600")})

    async def run():
        url = await replica.start()
        await replica.runner.cleanup()
        return url

    url = asyncio.run(run())
    seen, _ = asyncio.run(endpoints_after(replica, f"{url},tcp://127.0.0.1:5999"))
    assert seen == ["tcp://127.0.0.1:5999"] and replica.asked == 0


def test_a_vllm_without_the_route_keeps_the_default_port():
    async def run():
        simulator = await start_simulator(SimulatorConfig(port=0, schedule="none"))
        aggregator = Aggregator(PoolSettings(interval=0.5), [StaticSd([parse_flag(simulator.url, 5557)])])
        try:
            await aggregator.poll_once()
            return [m.replica.kv_events_endpoint for m in aggregator.members.values()], aggregator.latest
        finally:
            await aggregator.close()
            await simulator.stop()

    seen, samples = asyncio.run(run())
    assert seen == ["tcp://127.0.0.1:5557"]
    assert [s.value for s in samples if s.name == "kvcache_kv_events_discovered_endpoints"] == [0.0]
