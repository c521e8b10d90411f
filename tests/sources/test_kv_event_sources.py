"""Discovery of vLLM's KV-event publishers: both answer shapes, and hostile answers (another host, a
non-tcp scheme, thousands of ranks, a huge or malformed body) never pick a target. The HTTP side runs
against a real loopback server; the 0.32 answer's layout is asserted on real vLLM in
tests/integration/test_real_vllm_discovery.py."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import pytest
from aiohttp import web

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.kv_event_sources import (
    ENGINES,
    MAX_BODY_BYTES,
    MAX_RANKS,
    Announced,
    KvEventDiscovery,
    Stream,
    on_host,
    parse_vllm,
    read_answer,
    sources_url,
)
from kvcache_exporter.tools.harness import free_port
from tests.loopback import serve

VLLM = ENGINES["vllm"]
CAPTURED = Path(__file__).resolve().parents[1] / "fixtures" / "vllm-kv-event-sources"


def config(endpoint: str, topic: str = "kv", replay: str | None = None) -> dict:
    """One rank as vLLM 0.32's route serializes its KVEventsConfig."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "replay_endpoint": replay,
        "buffer_steps": 10000,
        "hwm": 100000,
        "max_queue_size": 100000,
        "topic": topic,
    }


def read(answer, host: str = "10.0.0.7"):
    return read_answer(json.dumps(answer).encode(), VLLM, host)


def test_real_vllm_032_answer():
    found = read_answer((CAPTURED / "one-engine.json").read_bytes(), VLLM, "127.0.0.1")
    assert found.streams == (Stream(0, "tcp://127.0.0.1:45579", "bind", "kv"),)
    assert found.state == "found" and not found.rejected and not found.other_host


def test_vllm_032_answer_keyed_by_rank():
    found = read({"0": config("tcp://*:5557"), "1": config("tcp://*:5558", replay="tcp://*:6000")})
    assert found.state == "found" and not found.rejected and not found.other_host
    assert found.streams == (
        Stream(0, "tcp://10.0.0.7:5557", "connect", "kv"),
        Stream(1, "tcp://10.0.0.7:5558", "connect", "kv", "tcp://10.0.0.7:6000"),
    )


@pytest.mark.parametrize("wrap", [lambda s: s, lambda s: {"sources": s}], ids=["bare", "sources"])
def test_newer_answer_a_list_of_ranks(wrap):
    sources = [
        {"data_parallel_rank": 1, "endpoint": "tcp://*:41234", "replay_endpoint": None, "topic": "kv"},
        {"data_parallel_rank": 0, "endpoint": "tcp://*:41233", "replay_endpoint": None, "topic": "kv"},
    ]
    found = read(wrap(sources))
    assert [(s.rank, s.endpoint, s.mode) for s in found.streams] == [
        (0, "tcp://10.0.0.7:41233", "connect"),
        (1, "tcp://10.0.0.7:41234", "connect"),
    ]


def test_a_concrete_address_is_where_vllm_connects_so_we_bind_it_on_the_polled_host():
    found = read({"0": config("tcp://127.0.0.1:5557")}, host="127.0.0.1")
    assert found.streams == (Stream(0, "tcp://127.0.0.1:5557", "bind", "kv"),) and not found.other_host


def test_another_host_in_the_answer_is_replaced_by_the_polled_one():
    found = read({"0": config("tcp://evil.example:5557", replay="tcp://203.0.113.9:6000")}, host="127.0.0.1")
    assert found.streams[0].endpoint == "tcp://127.0.0.1:5557"
    assert found.streams[0].replay_endpoint == "tcp://127.0.0.1:6000"
    assert found.other_host == (0,)
    assert "replaced by the polled one" in found.describe() and "evil" not in found.describe()


def test_ipv6_hosts_are_bracketed_and_wildcards_recognized():
    assert on_host("tcp://[::]:5557", "fd00::7") == ("tcp://[fd00::7]:5557", True, False)
    assert on_host("tcp://0.0.0.0:5557", "h") == ("tcp://h:5557", True, False)
    assert on_host("tcp://[fd00::7]:5557", "fd00::7") == ("tcp://[fd00::7]:5557", False, False)


@pytest.mark.parametrize(
    ("endpoint", "reason"),
    [
        ("ipc:///tmp/kv", "not_tcp"),
        ("inproc://kv", "not_tcp"),
        ("udp://*:5557", "not_tcp"),
        ("*:5557", "not_tcp"),
        ("tcp://*:0", "port_not_bound"),
        ("tcp://*:65536", "bad_port"),
        ("tcp://*:99999999999", "bad_port"),
        ("tcp://*", "bad_port"),
        ("tcp://*:-1", "bad_port"),
        ("tcp://*:\u0665\u0665\u0665\u0667", "bad_port"),  # Arabic-Indic digits: int() would read them
    ],
)
def test_unusable_endpoints_are_left_out_by_reason(endpoint, reason):
    found = read({"0": config(endpoint), "1": config("tcp://*:5558")})
    assert [s.rank for s in found.streams] == [1]
    assert found.rejected == {reason: 1}
    assert reason in found.describe()


def test_thousands_of_ranks_are_bounded():
    found = read({str(rank): config(f"tcp://*:{10000 + rank}") for rank in range(5000)})
    assert len(found.streams) == MAX_RANKS
    assert found.rejected == {"too_many_ranks": 5000 - MAX_RANKS}


def test_malformed_entries_are_left_out_not_fatal():
    answer = {
        "0": config("tcp://*:5557"),
        "x": config("tcp://*:5558"),
        "999": config("tcp://*:5559"),
        "2": "not a map",
        "3": {**config("tcp://*:5560"), "endpoint": 5560},
        "4": {**config("tcp://*:5561"), "topic": "t" * 10_000},
        "5": {**config("tcp://*:5562"), "publisher": "null"},  # publishes nothing: not an error
    }
    found = read(answer)
    assert [s.rank for s in found.streams] == [0]
    assert found.rejected == {"bad_rank": 1, "rank_out_of_range": 1, "bad_entry": 1, "bad_field": 2}


def test_a_rank_twice_keeps_the_first():
    announced, rejected = parse_vllm([{"data_parallel_rank": 0, "endpoint": "tcp://*:1"}] * 2)
    assert announced == [Announced(0, "tcp://*:1")] and rejected == {"duplicate_rank": 1}


def test_a_rank_must_be_a_whole_number():
    _, rejected = parse_vllm(
        [{"data_parallel_rank": True, "endpoint": "tcp://*:1"}, {"endpoint": "tcp://*:2"}]
    )
    assert rejected == {"bad_rank": 2}


@pytest.mark.parametrize("body", [b"{", b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'"text"', b"42"])
def test_a_body_that_is_not_an_answer_is_a_parse_error(body):
    with pytest.raises(SourceError) as err:
        read_answer(body, VLLM, "h")
    assert err.value.reason == "parse_error"


def test_no_rank_publishing_says_how_to_turn_events_on():
    found = read({})
    assert found.state == "none_published" and "--kv-events-config" in found.describe()


def test_the_route_is_asked_of_the_metrics_url_server():
    assert sources_url("https://u:p@vllm:8000/x/metrics?a=1", "/kv_event_sources") == (
        "https://u:p@vllm:8000/kv_event_sources",
        "vllm",
    )


async def ask(app: web.Application, **kwargs):
    runner, url = await serve(app)
    discovery = KvEventDiscovery(f"{url}/metrics", **kwargs)
    try:
        return await discovery.collect()
    finally:
        await discovery.close()
        await runner.cleanup()


def answering(handler) -> web.Application:
    app = web.Application()
    app.router.add_get("/kv_event_sources", handler)
    return app


def test_over_http_the_host_is_the_one_polled():
    port = free_port()  # nothing listens there: vLLM would connect to it

    async def sources(_):
        return web.json_response({"0": config(f"tcp://192.0.2.1:{port}")})

    found = asyncio.run(ask(answering(sources)))
    assert found.streams == (Stream(0, f"tcp://127.0.0.1:{port}", "bind", "kv"),) and found.other_host == (0,)


def test_a_server_without_the_route_is_an_answer_no_route():
    found = asyncio.run(ask(web.Application()))
    assert found.state == "no_route" and found.streams == ()
    assert "--kv-events.endpoint" in found.describe()


def test_a_huge_body_is_cut_at_the_bound():
    async def sources(_):
        return web.Response(body=b"[" + b"0," * MAX_BODY_BYTES + b"0]")

    with pytest.raises(SourceError) as err:
        asyncio.run(ask(answering(sources)))
    assert err.value.reason == "body_too_large"


def test_a_redirect_is_not_followed():
    async def sources(_):
        raise web.HTTPFound("http://192.0.2.1/kv_event_sources")

    with pytest.raises(SourceError) as err:
        asyncio.run(ask(answering(sources)))
    assert err.value.reason == "http_status"


def test_a_hung_server_costs_the_timeout():
    async def sources(_):
        await asyncio.sleep(5)
        return web.json_response({})

    with pytest.raises(SourceError) as err:
        asyncio.run(ask(answering(sources), timeout=0.2))
    assert err.value.reason == "timeout"


def test_a_concrete_address_already_listening_is_vllms_own_bind_so_we_connect():
    """vLLM binds `tcp://*:0` on the node's address and reports that address: a listener there."""
    listener = socket.create_server(("127.0.0.1", 0))
    bound, free = listener.getsockname()[1], free_port()

    async def sources(_):
        return web.json_response(
            {"0": config(f"tcp://127.0.0.1:{bound}"), "1": config(f"tcp://127.0.0.1:{free}")}
        )

    try:
        found = asyncio.run(ask(answering(sources)))
    finally:
        listener.close()
    assert [(s.endpoint, s.mode) for s in found.streams] == [
        (f"tcp://127.0.0.1:{bound}", "connect"),
        (f"tcp://127.0.0.1:{free}", "bind"),  # nothing listens: vLLM connects to it, we bind
    ]
