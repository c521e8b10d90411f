"""FleetEvents (aggregator/events.py): many publishers through one context and as few sockets as
addresses allow, told apart by sender address; serve's hostile KV-event classes (poison messages
among valid ones, a flood past the pending budget) against it, over real ZMQ on loopback."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import zmq

from kvcache_exporter.aggregator.events import FleetEvents, peer_key
from kvcache_exporter.sources.kv_events_decode import Batch, Dropped
from tests.conftest import SHARED_FIXTURES


def batch(seq: int, *hashes: int) -> list[bytes]:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": list(hashes)}], 0])
    return [b"kv", seq.to_bytes(8, "big"), payload]


@pytest.fixture
def publishers():
    context = zmq.Context()
    made = []

    def make(address: str) -> tuple[zmq.Socket, str]:
        sock = context.socket(zmq.PUB)
        sock.bind(f"tcp://{address}:*")
        made.append(sock)
        return sock, sock.getsockopt(zmq.LAST_ENDPOINT).decode()

    yield make
    context.destroy(linger=0)


def drained(events: FleetEvents, name: str, want: int, deadline: float = 10.0) -> list:
    """Drain `name` until `want` items (batches, or drops counted by their count) arrived."""
    got: list = []
    end = time.monotonic() + deadline
    while sum(i.count if isinstance(i, Dropped) else 1 for i in got) < want and time.monotonic() < end:
        got += events.drain(name).items
        time.sleep(0.05)
    return got


def send_when_subscribed(sock: zmq.Socket, events: FleetEvents, name: str, frames: list[list[bytes]]):
    """PUB/SUB drops what is sent before the subscription arrives: probe until one gets through."""
    end = time.monotonic() + 10
    while time.monotonic() < end:
        sock.send_multipart(batch(0, 0))
        time.sleep(0.1)
        if events.drain(name).items:
            break
    time.sleep(0.5)
    events.drain(name)  # the probes still in flight when the first arrived
    for each in frames:
        sock.send_multipart(each)


def test_two_publishers_on_one_socket_are_told_apart(publishers):
    a, a_endpoint = publishers("127.1.9.1")
    b, b_endpoint = publishers("127.1.9.2")
    events = FleetEvents(max_batches_per_second=0)
    events.add("a", a_endpoint)
    events.add("b", b_endpoint)
    try:
        send_when_subscribed(a, events, "a", [batch(1, 11), batch(2, 12)])
        send_when_subscribed(b, events, "b", [batch(5, 21)])
        got_a, got_b = drained(events, "a", 2), drained(events, "b", 1)
        assert [x.seq for x in got_a] == [1, 2] and [x.seq for x in got_b] == [5]
        assert got_b[0].events[0].block_hashes == (21,)
        assert events.lanes() == 1 and events.unknown_sender == 0
        assert events.healthy("a") and events.healthy("b")
    finally:
        asyncio.run(events.close())


def test_poison_messages_among_valid_ones_cost_only_themselves(publishers):
    sock, endpoint = publishers("127.1.9.3")
    events = FleetEvents(max_batches_per_second=0)
    events.add("r", endpoint)
    deep = b"\x91" * 100_000 + b"\x00"  # nesting far past any decoder's depth
    try:
        send_when_subscribed(
            sock,
            events,
            "r",
            [batch(1, 1), [b"kv", (2).to_bytes(8, "big"), b"\xc1garbage"],
             [b"kv", (3).to_bytes(8, "big"), deep], [b"kv"], batch(4, 4)],
        )  # fmt: skip
        got = drained(events, "r", 5)
        assert [(type(x).__name__, x.seq) for x in got if isinstance(x, Batch)] == [
            ("Batch", 1),
            ("Batch", 4),
        ]
        drops = [x for x in got if isinstance(x, Dropped)]
        assert sum(d.count for d in drops) == 3 and {d.reason for d in drops} == {"parse_error"}
    finally:
        asyncio.run(events.close())


def test_a_flood_past_the_pending_budget_is_dropped_and_counted(publishers):
    sock, endpoint = publishers("127.1.9.4")
    events = FleetEvents(max_batches_per_second=0, max_pending_hashes=10)
    events.add("r", endpoint)
    try:
        send_when_subscribed(
            sock, events, "r", [batch(seq, *range(seq * 8, seq * 8 + 8)) for seq in range(1, 5)]
        )
        got = drained(events, "r", 4)
        assert [x.seq for x in got if isinstance(x, Batch)] == [1]
        assert [(d.reason, d.seq, d.count) for d in got if isinstance(d, Dropped)] == [
            ("budget_exceeded", 2, 3)
        ]
    finally:
        asyncio.run(events.close())


def test_sockets_only_where_addresses_cannot_tell_publishers_apart():
    events = FleetEvents()
    try:
        for name, endpoint in [
            ("a", "tcp://10.0.0.1:5557"),
            ("b", "tcp://10.0.0.2:5557"),
            ("c", "tcp://10.0.0.1:5558"),  # a second rank of host a: another socket
            ("d", "tcp://vllm-0.pool:5557"),  # a name: its own socket
            ("e", "tcp://[fd00::1]:5557"),
        ]:
            events.add(name, endpoint)
        end = time.monotonic() + 5
        while not all(events.healthy(n) for n in "abcde") and time.monotonic() < end:
            time.sleep(0.05)
        assert all(events.healthy(n) for n in "abcde")
        assert events.lanes() == 3
        events.remove("c")
        events.remove("d")
        end = time.monotonic() + 5
        while events.lanes() != 1 and time.monotonic() < end:
            time.sleep(0.05)
        assert events.lanes() == 1
    finally:
        asyncio.run(events.close())


def test_peer_keys():
    assert peer_key("tcp://10.0.0.1:5557") == "10.0.0.1"
    assert peer_key("tcp://[fd00::1]:5557") == "fd00::1"
    assert peer_key("tcp://vllm-0:5557") is None and peer_key("ipc:///tmp/kv") is None


def test_an_sglang_replica_beside_a_vllm_one_is_read_by_its_own_rules(publishers):
    """SGLang's real captured frames with one merged event whose pages and token ids disagree:
    that event is refused and counted, its batch's others kept; the vLLM replica on the same socket
    is read as before."""
    captured = json.loads((SHARED_FIXTURES / "sglang-0.5.23" / "live-kv-frames.json").read_text())
    real = [[b"kv", m["seq"].to_bytes(8, "big"), bytes.fromhex(m["payload_hex"])] for m in captured]
    bad = {"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": None}
    bad |= {"token_ids": list(range(9)), "block_size": 4, "lora_id": None, "medium": "GPU"}
    good = {"type": "BlockRemoved", "block_hashes": [5], "medium": "CPU_PINNED"}
    mixed = [b"kv", (9).to_bytes(8, "big"), msgspec.msgpack.encode([1.0, [bad, good], 0])]
    s, s_endpoint = publishers("127.1.9.7")
    v, v_endpoint = publishers("127.1.9.8")
    events = FleetEvents(max_batches_per_second=0)
    events.add("s", s_endpoint, "sglang")
    events.add("v", v_endpoint)
    try:
        send_when_subscribed(s, events, "s", [*real, mixed])
        send_when_subscribed(v, events, "v", [batch(3, 30)])
        got = drained(events, "s", len(real) + 1)
        assert [x.seq for x in got] == [*(m["seq"] for m in captured), 9]
        assert not any(x.refused for x in got[:-1])
        assert got[-1].refused == ("invalid_block_size",)
        assert [(e.type, e.medium) for e in got[-1].events] == [("BlockRemoved", "CPU_PINNED")]
        assert got[0].events[0].session_id == "sess-1"
        assert drained(events, "v", 1)[0].events[0].block_hashes == (30,)
    finally:
        asyncio.run(events.close())
