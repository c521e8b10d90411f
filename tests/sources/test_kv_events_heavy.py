"""Valid but heavy KV-event batches (issue 23 item 1): bounded per message (bytes before decoding,
hashes and token ids per batch), per poll (what the subscriber queues, the time spent applying),
counted when dropped, and never in the way of /metrics polling of vLLM. The figures (stall seconds,
RSS) are in `python -m kvcache_exporter.tools.bench_kv_heavy`; here the bounds are asserted generously."""

from __future__ import annotations

import asyncio
import time
import tracemalloc

import msgspec
import pytest
import zmq

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_budget import CHUNK_HASHES, Budget, as_dropped
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.sources.kv_events import (
    RCV_HWM,
    ZMQ_MAX_MESSAGE_BYTES,
    ZMQ_QUEUE_BYTES,
    KvEventSubscriber,
    subscriber_socket,
)
from kvcache_exporter.sources.kv_events_decode import (
    MAX_BATCH_BYTES,
    MAX_HASHES_PER_BATCH,
    MAX_HASHES_PER_EVENT,
    MAX_TOKENS_PER_BATCH,
    Batch,
    Dropped,
    Event,
    KvEventDecodeError,
    KvEventDrain,
    decode_message,
)

from .test_kv_events import message, publisher, replay_router, until


def stored(hashes: list, tokens: int = 0, array: bool = False):
    size = 16 if tokens >= 16 * len(hashes) else 0  # a size its ids contradict would be refused
    if array:
        return ["BlockStored", hashes, None, [1] * tokens, size]
    return {"type": "BlockStored", "block_hashes": hashes, "token_ids": [1] * tokens, "block_size": size}


def heavy(total: int, per_event: int = MAX_HASHES_PER_EVENT, tokens: int = 0, array: bool = False) -> list:
    """A batch of `total` one-byte hashes, in events of at most `per_event`: each within its own bound."""
    sizes = [per_event] * (total // per_event) + ([total % per_event] if total % per_event else [])
    return [1.0, [stored([i % 128 for i in range(n)], tokens, array) for n in sizes], 0]


def too_heavy(frames: list[bytes], with_tokens: bool = False) -> KvEventDecodeError:
    with pytest.raises(KvEventDecodeError) as caught:
        decode_message(frames, with_tokens)
    assert caught.value.reason == "batch_too_heavy"
    return caught.value


# --- one message -----------------------------------------------------------------------------


def test_a_message_over_the_bytes_bound_is_refused_before_it_is_decoded():
    sha256s = [bytes([i % 256]) * 32 + bytes(32) for i in range(MAX_HASHES_PER_BATCH)]  # 64-byte hashes
    payload = msgspec.msgpack.encode([1.0, [stored(sha256s)], 0])  # valid, and within the hash bounds
    assert len(payload) > MAX_BATCH_BYTES
    tracemalloc.start()
    error = too_heavy([b"kv", (41).to_bytes(8, "big"), payload])
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert error.seq == 41 and "bytes" in str(error)
    assert peak < 1 << 20  # nothing decoded: the hashes alone would be ~6 MiB of bytes objects


@pytest.mark.parametrize("array", [False, True], ids=["map events", "array events"])
@pytest.mark.parametrize("with_tokens", [False, True])
def test_hashes_are_bounded_per_batch_not_only_per_event(array, with_tokens):
    per_event = MAX_HASHES_PER_BATCH // 4 + 1
    at_bound = decode_message(message(heavy(MAX_HASHES_PER_BATCH, per_event, array=array)), with_tokens)
    assert sum(len(e.block_hashes) for e in at_bound.events) == MAX_HASHES_PER_BATCH
    error = too_heavy(message(heavy(MAX_HASHES_PER_BATCH + 1, per_event, array=array), seq=9), with_tokens)
    assert error.seq == 9 and "block hashes" in str(error)


def test_token_ids_are_bounded_per_batch():
    per_event = MAX_TOKENS_PER_BATCH // 4
    fits = [1.0, [stored([i], per_event) for i in range(4)], 0]
    assert len(decode_message(message(fits), with_tokens=True).events) == 4
    over = [1.0, [stored([i], per_event) for i in range(4)] + [stored([4], 1)], 0]
    assert "token ids" in str(too_heavy(message(over), with_tokens=True))
    # without tokens (the aggregator) token ids are skipped, not decoded: nothing to bound
    assert len(decode_message(message(over)).events) == 5


def taken_while_not_reading(rcvhwm: int, messages: int = 48, size: int = 1 << 20) -> int:
    """How many of `messages` messages of `size` bytes serve's SUB socket (given `rcvhwm`) takes in
    while it is not reading: what one sees from a publisher that waits when the connection pushes back
    (an XPUB that never drops), before a message waits there 2 s. They are then read, in order."""
    ctx = zmq.Context()
    sub = subscriber_socket(ctx, "", ZMQ_MAX_MESSAGE_BYTES)
    sub.setsockopt(zmq.RCVHWM, rcvhwm)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 1)
    pub.setsockopt(zmq.XPUB_NODROP, 1)
    try:
        sub.connect(f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}")  # vLLM binds `*`
        assert pub.poll(30_000) and pub.recv() == b"\x01"  # the subscription, to everything
        payload, sent = b"x" * size, 0
        while sent < messages and offered(pub, [b"kv", sent.to_bytes(8, "big"), payload]):
            sent += 1
        read = []
        while sub.poll(1000):
            read.append(int.from_bytes(sub.recv_multipart()[1], "big"))
        assert read == list(range(len(read))) and len(read) >= sent - 1, (sent, read)
        return sent
    finally:
        pub.close(linger=0)
        sub.close(linger=0)
        ctx.term()


def offered(pub: zmq.Socket, frames: list[bytes], patience: float = 2.0) -> bool:
    """True once `frames` is sent; False when the connection pushed back for `patience` seconds."""
    deadline = time.monotonic() + patience
    while True:
        try:
            pub.send_multipart(frames, zmq.NOBLOCK)
            return True
        except zmq.Again:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


def test_a_burst_waits_at_the_publisher_not_in_libzmq():
    # libzmq keeps whole messages up to its high-water mark: bounded in bytes, the rest of a burst
    # stays behind TCP backpressure, where a publisher's own bound drops it (a gap: counted missed)
    assert RCV_HWM * MAX_BATCH_BYTES <= ZMQ_QUEUE_BYTES
    assert taken_while_not_reading(RCV_HWM) < 32  # 48 MiB offered; taken: the socket buffers and RCV_HWM
    assert taken_while_not_reading(10_000) == 48  # counting messages, libzmq took all of it


# --- one poll: what is queued, and the time to apply it -----------------------------------------


def batch(seq: int, hashes: int = CHUNK_HASHES) -> Batch:
    return Batch(seq, 1.0, (Event("BlockStored", tuple(range(seq * hashes, (seq + 1) * hashes))),))


class Ticks:
    """A clock that advances one second each time it is read."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_a_drain_is_applied_within_its_budget_and_the_rest_is_dropped_not_missed():
    drain = KvEventDrain((Dropped("parse_error", 0), *(batch(seq) for seq in range(1, 11))))
    state = PollState(retention=60)
    part = state.add_kv_events(EventState(), attribution=Attribution(), budget=3.5)
    part.clock = Ticks()  # read once for the deadline (1 + 3.5), then before each slice of one batch
    part.ingest(drain, 1.0)
    events, totals = part.events, part.attribution.totals
    assert (events.batches, events.dropped["budget_exceeded"], events.missed) == (3, 7, 0)
    assert events.dropped["parse_error"] == 1 and events.cached_blocks == 3 * CHUNK_HASHES
    assert totals.batches == 3  # attribution saw the same cut
    part.ingest(KvEventDrain((batch(11),)), 2.0)  # the next poll goes on where the dropped run ended
    assert (events.batches, events.missed, totals.batches) == (4, 0, 4)


def test_without_a_budget_the_drain_is_applied_whole():
    drain = KvEventDrain(tuple(batch(seq, 100) for seq in range(50)))
    assert list(Budget(None, Ticks()).slices(drain)) == [drain]
    slices = list(Budget(1e9, Ticks()).slices(drain))
    assert tuple(item for part in slices for item in part.items) == drain.items


def test_dropped_batches_keep_their_seqs_in_runs():
    items = (batch(5), batch(6), Dropped("rate_limited", 7, 2), batch(9), batch(11))
    assert as_dropped(items, "budget_exceeded") == (
        Dropped("budget_exceeded", 5, 2),
        Dropped("rate_limited", 7, 2),
        Dropped("budget_exceeded", 9, 1),
        Dropped("budget_exceeded", 11, 1),
    )


@pytest.mark.parametrize("with_tokens", [False, True])
def test_the_queue_between_polls_is_bounded_and_the_excess_counted(with_tokens):
    """Over real ZMQ: 10 batches of 300 hashes (and 3,000 token ids) into a queue of 1,000 hashes
    (10,000 token ids): 3 queued, 7 dropped; the next poll's queue starts empty again."""

    def payload(seq: int) -> list[bytes]:
        return message([1.0, [stored(list(range(seq * 300, seq * 300 + 300)), 3_000)]], seq)

    async def scenario():
        sub = KvEventSubscriber(
            "tcp://127.0.0.1:*", topic="kv", with_tokens=with_tokens,
            max_pending_hashes=1_000 if not with_tokens else 10**9, max_pending_tokens=10_000,
        )  # fmt: skip
        sub.start()
        state = EventState()
        try:
            async with publisher(sub.last_endpoint) as pub:
                for seq in range(10):
                    await pub.send_multipart(payload(seq))
                await until(lambda: sub.queued >= 10)
                assert sub.queued == 10  # 3 batches and a run of 7 drops
                state.ingest(sub.drain())
                await pub.send_multipart(payload(10))
                await until(lambda: sub.queued >= 1)
                state.ingest(sub.drain())
        finally:
            await sub.stop()
        return state

    state = asyncio.run(scenario())
    assert (state.batches, state.dropped["budget_exceeded"], state.missed) == (4, 7, 0)
    assert state.cached_blocks == 4 * 300


def test_replay_fetches_no_more_than_the_queue_can_take():
    """A gap of 10 batches of 300 hashes, replayed into a queue of 1,000: 3 fetched, 7 missed."""
    heavy_gap = {
        seq: message([1.0, [stored(list(range(seq * 300, seq * 300 + 300)))]])[2] for seq in range(1, 11)
    }

    async def scenario():
        async with replay_router(heavy_gap) as (endpoint, requests):
            sub = KvEventSubscriber(
                "tcp://127.0.0.1:*", topic="kv", replay_endpoint=endpoint, max_pending_hashes=1_000
            )
            sub.start()
            state = EventState()
            try:
                async with publisher(sub.last_endpoint) as pub:
                    await pub.send_multipart(message([1.0, []], 0))
                    await pub.send_multipart(message([1.0, []], 11))
                    await until(lambda: state.ingest(sub.drain()) or state.batches + state.missed >= 12)
            finally:
                await sub.stop()
            return state, requests

    state, requests = asyncio.run(scenario())
    assert requests == [1]
    assert (state.batches, state.missed, sum(state.dropped.values())) == (5, 7, 0)
    assert state.cached_blocks == 900


def test_a_heavy_batch_is_cut_between_events_and_its_rest_applied_first_by_the_next_poll():
    """Issue 33 item 4: one valid batch at every bound costs ~0.4 s of attribution; cut between its
    events, a poll stops within its budget and the next one goes on with the rest, nothing lost."""
    half = CHUNK_HASHES // 2
    heavy = Batch(
        0, 1.0, tuple(Event("BlockStored", tuple(range(i * half, (i + 1) * half))) for i in range(8))
    )
    state = PollState(retention=60)
    part = state.add_kv_events(EventState(), attribution=Attribution(), budget=1.5)
    part.clock = Ticks()  # deadline 1 + 1.5: the first slice (two events) in, then out of time
    part.ingest(KvEventDrain((heavy, batch(1, 10))), 1.0)
    events, totals = part.events, part.attribution.totals
    assert (events.batches, events.cached_blocks, events.dropped["budget_exceeded"]) == (1, CHUNK_HASHES, 1)
    assert len(part.carry) == 1 and len(part.carry[0].events) == 6 and part.carry[0].continued
    part.budget = None
    part.ingest(KvEventDrain(), 2.0)  # the rest first, counted with its start, not again
    assert (events.batches, events.cached_blocks, events.missed, part.carry) == (1, 4 * CHUNK_HASHES, 0, ())
    assert totals.batches == 1  # the event view's cursor is the one reader of the sequence
    part.ingest(KvEventDrain((batch(2, 10),)), 3.0)  # seq 1 was dropped, counted: 2 follows in order
    assert (events.batches, events.missed) == (2, 0)
