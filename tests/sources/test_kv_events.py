"""KV-event source: decoding, state and the ZMQ subscriber, against the real vLLM 0.32.0 capture."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvcache_exporter.derive.kv_events import EventState, kv_event_samples
from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.kv_events import (
    MAX_PENDING,
    KvEventDecodeError,
    KvEventSubscriber,
    decode_message,
    queue_drop,
    subscriber_mode,
)
from kvcache_exporter.sources.kv_events_decode import Batch, Dropped, Event, TokenBucket
from kvcache_exporter.tools.harness import free_port

SYSTEM_BLOCK_HASHES = [
    12944168452656833345,
    16808921115217477996,
    10876171651061564582,
    8726855019544329341,
    10142152496010988370,
    7150854816336387872,
]
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def message(payload: Any, seq: int = 0) -> list[bytes]:
    return [b"kv", seq_bytes(seq), msgspec.msgpack.encode(payload)]


def values(samples) -> dict[tuple, float]:
    return {(s.name, *sorted(s.labels.items())): s.value for s in samples}


def fed(sub: KvEventSubscriber, state: EventState) -> EventState:
    """What the poll loop does with the subscriber each poll: drain it into the poll state."""
    state.ingest(sub.drain())
    return state


def replayed(frames: list[list[bytes]]) -> EventState:
    state = EventState()
    for m in frames:
        state.apply(decode_message(m))
    return state


# --- decoding the real capture ---------------------------------------------------------------


def test_decodes_all_real_frames_with_the_readme_totals(kv_frames):
    batches = [decode_message(m) for m in kv_frames]

    def events(kind):
        return [e for b in batches for e in b.events if e.type == kind]

    assert len(batches) == 351
    assert [b.seq for b in batches] == list(range(351))
    assert {b.dp_rank for b in batches} == {0}
    assert all(1.7e9 < b.ts < 1.9e9 for b in batches)
    assert len(events("BlockStored")) == 300
    assert sum(len(e.block_hashes) for e in events("BlockStored")) == 1375
    assert len(events("BlockRemoved")) == 1281
    assert sum(len(e.block_hashes) for e in events("BlockRemoved")) == 1281
    assert events("AllBlocksCleared") == []


def test_real_stream_state(kv_frames, num_gpu_blocks):
    state = EventState()
    for m in kv_frames:
        batch = decode_message(m)
        state.apply(batch)
        stored_after: set[int] = set()
        for event in reversed(batch.events):
            if event.type == "BlockRemoved":
                assert not any((h in state.resident) for h in set(event.block_hashes) - stored_after)
            stored_after |= set(event.block_hashes) if event.type == "BlockStored" else set()
        assert 0 < state.cached_blocks <= num_gpu_blocks  # the event view cannot exceed the real pool
    assert all((h in state.resident) for h in SYSTEM_BLOCK_HASHES)
    assert values(kv_event_samples(state)) == {
        ("kvcache_kv_events_batches_total",): 351,
        ("kvcache_kv_events_total", ("type", "BlockStored")): 300,
        ("kvcache_kv_events_total", ("type", "BlockRemoved")): 1281,
        ("kvcache_kv_events_total", ("type", "AllBlocksCleared")): 0,
        ("kvcache_kv_events_missed_batches_total",): 0,
        ("kvcache_kv_events_publisher_restarts_total",): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "rate_limited")): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "too_many_blocks")): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "parse_error")): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "batch_too_heavy")): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "budget_exceeded")): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "invalid_event")): 0,
        ("kvcache_kv_events_dropped_total", ("reason", "invalid_block_size")): 0,
        ("kvcache_kv_events_cached_blocks",): 1375 - 1281,
    }


def test_gaps_in_the_real_stream_are_missed_batches(kv_frames):
    removed = {10, 11, 12, 200, 350}
    state = replayed([m for i, m in enumerate(kv_frames) if i not in removed])
    assert state.missed == 4  # the last one is not a gap yet: nothing came after it
    assert state.batches == 351 - len(removed)
    assert state.restarts == 0


def test_missing_names_the_lost_range(kv_frames):
    state = replayed(kv_frames[:10])
    assert state.missing(10) == range(0)
    assert state.missing(14) == range(10, 14)
    assert EventState().missing(123) == range(0)  # joining a running stream is not a gap


def test_seq_back_to_zero_is_a_new_publisher_not_a_gap(kv_frames):
    state = replayed(kv_frames + kv_frames[:100])
    fresh = replayed(kv_frames[:100])
    assert state.missed == 0
    assert state.restarts == 1
    assert state.batches == 451  # counters stay monotonic
    assert state.cached_blocks == fresh.cached_blocks  # ...but the cache view restarted
    assert all((h in state.resident) == (h in fresh.resident) for h in SYSTEM_BLOCK_HASHES)


def test_restart_seen_late_counts_the_new_publishers_lost_batches(kv_frames):
    state = replayed(kv_frames[:300] + kv_frames[5:10])
    assert state.restarts == 1
    assert state.missed == 5


@pytest.mark.parametrize(
    ("frames", "seq"),
    [
        ([], None),
        ([b"kv"], None),
        ([b"kv", b"\x00\x01", msgspec.msgpack.encode([1.0, []])], None),
        ([b"kv", seq_bytes(7), msgspec.msgpack.encode([1.0, []]), b"extra"], None),
        ([b"kv", seq_bytes(7), b"\xc1"], 7),  # 0xc1 is never valid msgpack
        ([b"kv", seq_bytes(7), b""], 7),
        (message(42, 7), 7),
        (message([1.0], 7), 7),
        (message(["yesterday", []], 7), 7),
        (message([1.0, {"type": "BlockStored"}], 7), 7),
        (message([1.0, [], "rank-zero"], 7), 7),
    ],
)
def test_malformed_messages_raise_a_typed_parse_error(frames, seq):
    with pytest.raises(KvEventDecodeError) as caught:
        decode_message(frames)
    assert caught.value.reason == "parse_error"
    assert caught.value.seq == seq


@pytest.mark.parametrize(
    "bad",
    [
        {"block_hashes": [1]},
        [],
        ["BlockStored", ["not-a-hash"]],
        {"type": "BlockRemoved"},
        {"type": 3, "block_hashes": [1]},
    ],
)
def test_a_malformed_event_is_refused_and_its_batch_kept(bad):
    good = {"type": "BlockStored", "block_hashes": [1]}
    batch = decode_message(message([1.0, [good, bad, good]], 7))
    assert [e.block_hashes for e in batch.events] == [(1,), (1,)]
    assert batch.refused == ("invalid_event",)
    assert batch.problem.startswith("batch seq 7 event 1: ")


def test_parse_errors_are_dropped_without_faking_a_gap(kv_frames):
    state = EventState()
    for m in kv_frames[:5]:
        state.apply(decode_message(m))
    try:
        decode_message([b"kv", seq_bytes(5), b"\xc1"])
    except KvEventDecodeError as err:
        state.drop(err.reason, err.seq)
    state.apply(decode_message(kv_frames[6]))
    assert (state.dropped["parse_error"], state.missed, state.batches) == (1, 0, 6)


def test_tolerates_later_and_unknown_shapes():
    payload = {
        "ts": 5.5,
        "events": [
            {"type": "BlockStored", "block_hashes": [b"\x01" * 32], "new_field": {"x": 1}},
            {"type": "BlockMoved", "block_hashes": [1]},
            ["AllBlocksCleared"],
        ],
        "data_parallel_rank": 2,
        "publisher_note": "ignored",
    }
    publisher_id = b"\xab" * 16
    batch = decode_message([seq_bytes(9) + publisher_id, msgspec.msgpack.encode(payload)])
    assert batch == Batch(
        9,
        5.5,
        (Event("BlockStored", (b"\x01" * 32,)), Event("BlockMoved"), Event("AllBlocksCleared")),
        2,
    )
    state = EventState()
    state.apply(batch)
    assert state.events == {"BlockStored": 1, "other": 1, "AllBlocksCleared": 1}
    assert state.cached_blocks == 0


def test_bytes_hashes_are_tracked_like_ints():
    state = EventState()
    state.apply(Batch(0, 1.0, (Event("BlockStored", (b"a", b"b", 3)),)))
    state.apply(Batch(1, 1.0, (Event("BlockRemoved", (b"a",)),)))
    assert ((b"a" in state.resident), (b"b" in state.resident), (3 in state.resident)) == (False, True, True)
    state.apply(Batch(2, 1.0, (Event("AllBlocksCleared"),)))
    assert state.cached_blocks == 0


def test_one_batch_is_applied_in_stream_order():
    """Removals are applied together (one set operation per run), never past the event after them."""
    state = EventState()
    removed, stored = Event("BlockRemoved", (1,)), Event("BlockStored", (1, 2))
    state.apply(Batch(0, 1.0, (stored, removed, Event("BlockRemoved", (2,)))))
    assert state.cached_blocks == 0
    state.apply(Batch(1, 1.0, (stored, removed, stored)))  # evicted, then computed again
    assert state.resident == {1, 2}
    state.apply(Batch(2, 1.0, (removed, Event("AllBlocksCleared"), Event("BlockStored", (3,)), removed)))
    assert state.resident == {3}
    assert state.events == {"BlockStored": 4, "BlockRemoved": 5, "AllBlocksCleared": 1}


# --- older and newer encodings -----------------------------------------------------------------


class ArrayBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's early EventBatch (and the example subscriber): an array, events tagged arrays too."""

    ts: float
    events: list[Any]


class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(ArrayEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class BlockRemoved(ArrayEvent):
    block_hashes: list[int]


class MapBatch(msgspec.Struct, omit_defaults=True):
    """A later map-encoded KVEventBatch (no array_like), events as tagged maps."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def old_event(raw: dict) -> ArrayEvent:
    if raw["type"] == "BlockStored":
        fields = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id")
        return BlockStored(**{f: raw[f] for f in fields})
    return BlockRemoved(block_hashes=raw["block_hashes"])


def test_array_like_encoding_decodes_to_the_same_events(kv_frames):
    for topic, seq, payload in kv_frames:
        ts, events, _rank = msgspec.msgpack.decode(payload)
        old = msgspec.msgpack.encode(ArrayBatch(ts, [old_event(e) for e in events]))
        assert msgspec.msgpack.decode(old)[1][0][0] in ("BlockStored", "BlockRemoved")  # tag first
        expected = decode_message([topic, seq, payload])
        assert decode_message([topic, seq, old]) == expected._replace(dp_rank=None)


def test_map_encoded_batches_decode_to_the_same_events(kv_frames):
    for topic, seq, payload in kv_frames[::10]:
        ts, events, rank = msgspec.msgpack.decode(payload)
        encoded = msgspec.msgpack.encode(MapBatch(ts, events, rank))
        assert isinstance(msgspec.msgpack.decode(encoded), dict)
        assert decode_message([seq, encoded]) == decode_message([topic, seq, payload])


# --- bounds ------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def offer(bucket: TokenBucket, state: EventState, frames: list[bytes]) -> None:
    """What the subscriber does with each message on arrival (minus replay), applied at once."""
    if bucket.take():
        state.apply(decode_message(frames))
    else:
        state.drop("rate_limited", int.from_bytes(frames[1], "big"))


def test_rate_bound_drops_the_excess_and_refills(kv_frames):
    clock = FakeClock()
    state, bucket = EventState(), TokenBucket(10, clock)
    for m in kv_frames[:25]:
        offer(bucket, state, m)
    assert (state.batches, state.dropped["rate_limited"]) == (10, 15)
    clock.now += 0.5
    for m in kv_frames[25:35]:
        offer(bucket, state, m)
    assert (state.batches, state.dropped["rate_limited"]) == (15, 20)
    assert state.missed == 0  # dropped on purpose is not lost in transit


def test_block_bound(kv_frames):
    state = EventState(max_blocks=50)
    for m in kv_frames:
        state.apply(decode_message(m))
        assert state.cached_blocks <= 50
    assert state.dropped["too_many_blocks"] > 0
    assert (
        values(kv_event_samples(state))[("kvcache_kv_events_dropped_total", ("reason", "too_many_blocks"))]
        > 0
    )


def test_subscriber_mode_mirrors_vllm():
    assert subscriber_mode("tcp://127.0.0.1:5557") == "bind"
    assert subscriber_mode("tcp://vllm-0.vllm:5557") == "bind"
    for endpoint in ("tcp://*:5557", "tcp://[::]:5557", "ipc:///tmp/kv", "inproc://kv"):
        assert subscriber_mode(endpoint) == "connect"
    with pytest.raises(ValueError):
        KvEventSubscriber("tcp://127.0.0.1:5557", mode="listen")


# --- over real ZMQ ------------------------------------------------------------------------------


async def until(predicate, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def publisher(endpoint: str):
    """A PUB that connects like vLLM's; XPUB so the test can wait for the subscription to arrive."""
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)
    try:
        async with asyncio.timeout(5):
            assert (await pub.recv())[:1] == b"\x01"
        yield pub
    finally:
        pub.close(linger=0)
        ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def replay_router(buffer: dict[int, bytes]):
    """vLLM's replay service: [id, b"", start] in; [id, b"", seq, payload] per batch, then the end marker."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    requests: list[int] = []

    async def serve():
        while True:
            client, empty, start = await router.recv_multipart()
            assert empty == b""
            requests.append(int.from_bytes(start, "big"))
            for seq in sorted(buffer):
                if seq >= requests[-1]:
                    await router.send_multipart([client, b"", seq_bytes(seq), buffer[seq]])
            await router.send_multipart([client, b"", END_OF_REPLAY, b""])

    task = asyncio.get_running_loop().create_task(serve())
    try:
        yield router.getsockopt(zmq.LAST_ENDPOINT).decode(), requests
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        router.close(linger=0)
        ctx.destroy(linger=0)


async def stream(frames: list[list[bytes]], replay: dict[int, bytes] | None = None) -> tuple[dict, list]:
    """Publish `frames` to a bound subscriber; return its samples and the replay requests it made."""
    async with contextlib.AsyncExitStack() as stack:
        replay_endpoint, requests = None, []
        if replay is not None:
            replay_endpoint, requests = await stack.enter_async_context(replay_router(replay))
        sub = KvEventSubscriber("tcp://127.0.0.1:*", topic="kv", replay_endpoint=replay_endpoint)
        sub.start()
        stack.push_async_callback(sub.stop)
        assert sub.healthy and sub.last_endpoint.startswith("tcp://127.0.0.1:")
        pub = await stack.enter_async_context(publisher(sub.last_endpoint))
        await pub.send_multipart([b"other-topic", seq_bytes(0), b"\xc1"])  # filtered out by the topic
        for m in frames:
            await pub.send_multipart(m)
        last = int.from_bytes(frames[-1][1], "big")
        state = EventState()
        await until(lambda: fed(sub, state).batches + state.missed >= last + 1)
        assert sub.healthy and sub.last_message_time is not None
        return values(kv_event_samples(state)), requests


def test_end_to_end_over_zmq(kv_frames):
    got, _ = asyncio.run(stream(kv_frames))
    assert got == values(kv_event_samples(replayed(kv_frames)))


def test_replay_fills_a_gap(kv_frames):
    live = [m for m in kv_frames if not 100 <= int.from_bytes(m[1], "big") < 110]
    buffer = {int.from_bytes(seq, "big"): payload for _, seq, payload in kv_frames}
    got, requests = asyncio.run(stream(live, replay=buffer))
    assert requests == [100]
    assert got == values(kv_event_samples(replayed(kv_frames)))


def test_replay_counts_what_it_could_not_fill(kv_frames):
    live = [m for m in kv_frames if not 100 <= int.from_bytes(m[1], "big") < 110]
    buffer = {s: p for _, seq, p in kv_frames if (s := int.from_bytes(seq, "big")) >= 104}
    got, requests = asyncio.run(stream(live, replay=buffer))
    assert requests == [100]
    assert got[("kvcache_kv_events_missed_batches_total",)] == 4
    assert got[("kvcache_kv_events_batches_total",)] == 351 - 4


def test_subscriber_survives_a_taken_port_and_retries():
    async def scenario():
        ctx = zmq.asyncio.Context()
        holder = ctx.socket(zmq.SUB)
        holder.bind("tcp://127.0.0.1:*")
        sub = KvEventSubscriber(holder.getsockopt(zmq.LAST_ENDPOINT).decode())
        try:
            sub.start()
            await asyncio.sleep(0.05)
            assert not sub.healthy
            with pytest.raises(SourceError) as caught:
                await sub.collect()
            assert caught.value.reason == "zmq_error"
            holder.close(linger=0)
            await until(lambda: sub.healthy, timeout=5)  # the loop retried and bound the port
        finally:
            await sub.stop()
            holder.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_the_simulators_publisher_with_gaps_and_replay():
    """Cross-check with the project's simulator: its PUB connects to us and loses every 5th batch on the wire.

    Like a vLLM high-water-mark drop, the lost batches stay in the publisher's replay buffer, so the
    subscriber fills every gap through the replay ROUTER and nothing stays missed."""
    from kvcache_exporter.simulator.blocks import BlockRemoved as SimRemoved
    from kvcache_exporter.simulator.blocks import BlockStored as SimStored
    from kvcache_exporter.simulator.kv_events import KVEventPublisher

    async def scenario():
        ctx = zmq.asyncio.Context()
        replay_endpoint = f"tcp://127.0.0.1:{free_port()}"  # for the simulator's replay ROUTER
        sub = KvEventSubscriber("tcp://127.0.0.1:*", "bind", "kv", replay_endpoint, replay_timeout=30)
        sub.start()
        pub = KVEventPublisher(ctx, sub.last_endpoint, replay_endpoint, "kv", rank=0)
        state = EventState()
        try:
            while fed(sub, state).batches == 0:  # PUB/SUB loses what is sent before the subscription arrives
                await pub.publish([SimStored([1], None, [0] * 16, 16)])
                await asyncio.sleep(0.01)
            pub.drop_every = 5
            for i in range(100):
                await pub.publish([SimStored([1000 + i], None, [i] * 16, 16), SimRemoved([1000 + i - 1])])
            pub.drop_every = 0
            await pub.publish([SimStored([2000], None, [0] * 16, 16)])  # reveals the last lost batch
            await until(lambda: 2000 in fed(sub, state).resident, timeout=10)
            assert 1099 in state.resident  # the 100th batch was lost on the wire, then replayed
            assert state.cached_blocks == 3  # 1, 1099 and 2000
            assert state.missed == 0
            assert state.missing(pub.seq) == range(0)  # every seq it used was applied or replayed
        finally:
            await pub.close()
            await sub.stop()
            ctx.destroy(linger=0)

    asyncio.run(scenario())


def test_an_unknown_event_type_in_the_032_shape_falls_back_and_still_decodes(kv_frames):
    topic, seq, payload = kv_frames[44]
    ts, events, rank = msgspec.msgpack.decode(payload)
    extended = msgspec.msgpack.encode([ts, [*events, {"type": "BlockPinned", "block_hashes": [7]}], rank])
    batch = decode_message([topic, seq, extended])
    assert batch.events == (*decode_message(kv_frames[44]).events, Event("BlockPinned"))


def test_a_run_of_drops_is_one_item_and_a_full_queue_only_counts():
    pending: list = []
    for seq in (5, 6, 7):
        queue_drop(pending, "rate_limited", seq)
    queue_drop(pending, "rate_limited", 9)  # 8 is missing: a run of its own
    queue_drop(pending, "parse_error", 10)
    queue_drop(pending, "parse_error", None)  # unreadable seq: cannot continue a numbered run
    assert pending == [
        Dropped("rate_limited", 5, 3),
        Dropped("rate_limited", 9),
        Dropped("parse_error", 10),
        Dropped("parse_error", None),
    ]
    full: list = [Batch(seq, 0.0, ()) for seq in range(MAX_PENDING)]
    for seq in range(MAX_PENDING, MAX_PENDING + 3):
        queue_drop(full, "parse_error", seq)
    assert full[MAX_PENDING:] == [Dropped("rate_limited", None, 3)]
