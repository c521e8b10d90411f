"""KV-event discovery on the REAL vLLM 0.32 CPU server: `serve` (and `aggregate`) is given vLLM's
/metrics URL and no KV-event flag at all, and finds every rank's stream from vLLM's own GET
/kv_event_sources.

Runs against the session's servers (one engine, and data parallel 2 from test_real_vllm_shapes.py),
so it starts no vLLM of its own; the one-engine server is restarted once, on another KV-event port.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from kvcache_exporter.aggregator.discovery import StaticSd, parse_flag
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from kvcache_exporter.tools.harness import free_port
from tests.integration.miss_tokens import scrape, send, tokens, warm_up

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

FOUND = "KV events from vLLM's /kv_event_sources: "


def discovery_args(server) -> tuple[str, ...]:
    return ("--vllm.url", server.metrics_url, "--collect.interval", "1s", "--gpu.source", "none")


def value(samples, name: str, **labels: str) -> float:
    return sum(v for n, got, v in samples if n == name and all(got.get(k) == w for k, w in labels.items()))


def wait_log(process, text: str, count: int = 1, timeout: float = 60.0) -> str:
    """The log once `text` is in it `count` times."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        log = process.log(400)
        if log.count(text) >= count:
            return log
        time.sleep(0.2)
    pytest.fail(
        f"{text!r} not logged {count} time(s) within {timeout:.0f} s:\n{process.log()}", pytrace=False
    )


def test_vllm_answers_its_sources_keyed_by_rank(vllm_server) -> None:
    status, body = vllm_server.get("/kv_event_sources")
    assert status == 200, body
    answer = json.loads(body)
    assert list(answer) == ["0"]
    assert answer["0"]["endpoint"] == vllm_server.kv_events_endpoint and answer["0"]["topic"] == "kv"


def test_one_engine_found_then_followed_across_a_restart_on_another_port(vllm_server, start_exporter) -> None:
    server, rng = vllm_server, random.Random(11)
    with start_exporter(*discovery_args(server)) as exporter:
        log = wait_log(exporter, FOUND)
        assert f"{FOUND}rank 0 {server.kv_events_endpoint} (bind)" in log
        warm_up(exporter, server, rng, 32 + 3)  # until the stream's misses show: events arrived
        samples = scrape(exporter)
        assert value(samples, "kvcache_kv_events_discovered_endpoints") == 1
        assert value(samples, "kvcache_kv_events_discovery_state", state="found") == 1
        assert value(samples, "kvcache_kv_events_batches_total") > 0
        assert not any(n == "kvcache_kv_events_batches_total" and "engine" in got for n, got, _ in samples)

        old = server.kv_events_port
        while server.kv_events_port in (old, server.port):
            server.kv_events_port = free_port()
        print(f"vLLM restarted on KV-event port {server.kv_events_port} in {server.restart():.1f} s")
        log = wait_log(exporter, FOUND, count=2)
        assert log.split(FOUND)[-1].startswith(f"rank 0 {server.kv_events_endpoint} (bind)")
        before = value(scrape(exporter), "kvcache_kv_events_batches_total")
        deadline = time.monotonic() + 60
        while value(scrape(exporter), "kvcache_kv_events_batches_total") <= before:
            assert time.monotonic() < deadline, exporter.log()
            send(server, tokens(rng, 32 + 3))
            time.sleep(1)
        samples = scrape(exporter)
        assert value(samples, "kvcache_kv_events_discovery_changes_total") == 1
        assert value(samples, "kvcache_kv_events_publisher_restarts_total") >= 1


def test_data_parallel_ranks_found_and_attributed(vllm_dp_lora, start_exporter) -> None:
    server, engines = vllm_dp_lora, ("0", "1")
    status, body = server.get("/kv_event_sources")
    ports = {rank: int(source["endpoint"].rpartition(":")[2]) for rank, source in json.loads(body).items()}
    assert status == 200 and ports == {"0": server.kv_events_port, "1": server.kv_events_port + 1}, body

    def route(engine):
        return {"X-data-parallel-rank": engine}

    with start_exporter(*discovery_args(server)) as exporter:
        log = wait_log(exporter, FOUND)
        assert (
            f"rank 0 tcp://127.0.0.1:{ports['0']} (bind); rank 1 tcp://127.0.0.1:{ports['1']} (bind)" in log
        )
        warm_up(exporter, server, random.Random(12), 32 + 3, engines, route)  # both ranks attributed
        samples = scrape(exporter)
        assert value(samples, "kvcache_kv_events_discovered_endpoints") == 2
        for engine in engines:
            assert value(samples, "kvcache_kv_events_batches_total", engine=engine) > 0, engine


def test_aggregate_follows_every_rank_of_a_data_parallel_replica(vllm_dp_lora) -> None:
    """`aggregate --replica HOST:PORT`, no KV flag: both ranks' streams from /kv_event_sources (vLLM
    connects out to its own address, so the aggregator, on vLLM's host here, binds it), each rank's
    blocks under the one replica, summed, and no rank's block counted as another replica's."""
    server, rng = vllm_dp_lora, random.Random(13)
    prompt = tokens(rng, 2 * 32 + 3)  # two full blocks, to each rank

    async def run():
        settings = PoolSettings(interval=1.0, kv_sources_every=0.0)
        aggregator = Aggregator(settings, [StaticSd([parse_flag(f"127.0.0.1:{server.port}", None)])])
        try:
            await aggregator.poll_once()
            ((name, member),) = aggregator.members.items()
            streams = [(s.rank, s.endpoint, s.mode) for s in member.replica.streams()]
            view, deadline = aggregator.fleet.replicas[name], time.monotonic() + 90
            while not all(view.ranks.get(r) and view.ranks[r].resident for r in (0, 1)):
                assert time.monotonic() < deadline, (streams, view)
                for engine in ("0", "1"):  # vLLM's PUB reconnects to our fresh bind in the background
                    await asyncio.to_thread(send, server, prompt, headers={"X-data-parallel-rank": engine})
                await aggregator.poll_once()
            return aggregator, name, streams
        finally:
            await aggregator.close()

    aggregator, name, streams = asyncio.run(run())
    ports = (server.kv_events_port, server.kv_events_port + 1)
    assert streams == [(rank, f"tcp://127.0.0.1:{port}", "bind") for rank, port in enumerate(ports)]
    fleet = aggregator.fleet
    view = fleet.replicas[name]
    assert list(fleet.replicas) == [name] and view.resident == view.ranks[0].resident + view.ranks[1].resident
    assert view.ranks[0].resident >= 2 and view.ranks[1].resident >= 2, view
    assert (view.other_replica, fleet.duplicates, view.restarts) == (0, 0, 0), view
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in aggregator.latest}
    assert samples[("kvcache_kv_events_discovered_endpoints", (("replica", name),))] == 2
    success = ("kvcache_exporter_collector_success", (("collector", "kv_events"), ("replica", name)))
    assert samples[success] == 1
    print(f"aggregate, DP 2: {streams}; resident per rank {view.ranks[0].resident}, {view.ranks[1].resident}")
