"""A flood of KV events (issue 14 item 4): the rate bound holds on arrival, every message is
accounted for, and the event loop (which answers scrapes) is never held up by the stream."""

from __future__ import annotations

import asyncio
import threading
import time

import zmq

from kvcache_exporter.derive.kv_events import EventState, kv_event_samples
from kvcache_exporter.sources.kv_events import KvEventSubscriber

RATE = 5_000
FLOOD = 100_000


def flood(endpoint: str, payloads: list[bytes], done: threading.Event, sent_at: list[float]) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)  # nothing dropped on our side: whatever is lost, the subscriber lost
    pub.setsockopt(zmq.LINGER, 5000)
    pub.connect(endpoint)
    time.sleep(0.3)  # PUB/SUB: the subscription must reach the publisher first
    sent_at.append(time.monotonic())
    for seq in range(FLOOD):
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payloads[seq % len(payloads)]])
    sent_at.append(time.monotonic())
    pub.close()
    ctx.term()
    done.set()


def test_a_flood_is_rate_limited_on_arrival_and_never_blocks_the_loop(kv_frames):
    payloads = [payload for _, _, payload in kv_frames]

    async def scenario():
        sub = KvEventSubscriber("tcp://127.0.0.1:*", topic="kv", max_batches_per_second=RATE)
        sub.start()
        done, sent_at = threading.Event(), []
        sender = threading.Thread(target=flood, args=(sub.last_endpoint, payloads, done, sent_at))
        worst_lag, state = 0.0, EventState()
        sender.start()
        try:
            while True:  # what a scrape needs: the loop gets to run, often
                before = time.monotonic()
                await asyncio.sleep(0.01)
                worst_lag = max(worst_lag, time.monotonic() - before - 0.01)
                state.ingest(await sub.collect())  # what each poll does
                if done.is_set() and state.batches + state.dropped["rate_limited"] + state.missed >= FLOOD:
                    break
                assert not sent_at or time.monotonic() - sent_at[0] < 150, "the flood was never accounted for"
            received_by = time.monotonic()
            samples = kv_event_samples(state)
        finally:
            sender.join()
            await sub.stop()
        return state, samples, sent_at, received_by, worst_lag

    state, samples, sent_at, received_by, worst_lag = asyncio.run(scenario())
    # every batch sent is applied, dropped on purpose or counted missed: nothing unaccounted
    assert state.batches + state.dropped["rate_limited"] + state.missed == FLOOD
    # the bound holds over the flood as it arrived: one second of burst plus the rate over its length
    assert state.batches <= RATE * (received_by - sent_at[0]) + RATE
    assert state.batches < FLOOD / 2  # far from 86 % let through
    assert state.dropped["rate_limited"] > 0
    assert worst_lag < 1.0, f"the event loop was held up for {worst_lag:.2f}s"
    assert {s.name for s in samples} >= {"kvcache_kv_events_batches_total", "kvcache_kv_events_dropped_total"}
