"""The one KV-event intake (serve's subscriber and the aggregator's lanes): rate on arrival, the
pending budget before decoding, decode errors counted, drops merged, the cursor replay reads."""

from __future__ import annotations

import msgspec

from kvcache_exporter.sources.kv_events_decode import MAX_BATCH_BYTES, Batch, Dropped, decode_message
from kvcache_exporter.sources.kv_intake import KvIntake


def frames(seq: int, *hashes: int) -> list[bytes]:
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": list(hashes)}]])
    return [b"kv", seq.to_bytes(8, "big"), payload]


def take_all(intake: KvIntake, messages: list[list[bytes]]) -> list[Batch | Dropped]:
    for message in messages:
        if (batch := intake.take(message)) is not None:
            intake.put(batch)
    return list(intake.drain().items)


def test_the_real_stream_goes_through_in_order(kv_frames):
    intake = KvIntake(max_batches_per_second=0, with_tokens=True)
    got = take_all(intake, kv_frames)
    assert [b.seq for b in got] == [decode_message(f).seq for f in kv_frames]
    assert intake.queued == 0 and intake.drain().items == ()  # drained once


def test_past_the_rate_messages_are_counted_not_decoded():
    clock = [0.0]
    intake = KvIntake(max_batches_per_second=2, clock=lambda: clock[0])
    got = take_all(intake, [frames(seq, seq) for seq in range(5)])
    assert [b.seq for b in got if isinstance(b, Batch)] == [0, 1]
    assert [d for d in got if isinstance(d, Dropped)] == [Dropped("rate_limited", 2, 3)]  # one run


def test_past_the_budget_a_message_is_dropped_and_the_cursor_moves_past_it():
    intake = KvIntake(max_batches_per_second=0, max_pending_hashes=4)
    got = take_all(intake, [frames(0, 1, 2, 3), frames(1, 4, 5), frames(2, 6), frames(3, 7)])
    assert [b.seq for b in got if isinstance(b, Batch)] == [0, 2]  # 1 would pass the bound; 2 fits
    assert [d for d in got if isinstance(d, Dropped)] == [
        Dropped("budget_exceeded", 1),
        Dropped("budget_exceeded", 3),
    ]
    assert intake.cursor.next == 4 and intake.cursor.gap(4) == range(0)  # drops are no gap to replay
    assert intake.cursor.gap(9) == range(4, 9)


def test_a_message_over_the_bytes_bound_is_named_so_even_when_the_queue_is_full():
    intake = KvIntake(max_batches_per_second=0, max_pending_hashes=4)
    heavy = [b"kv", (2).to_bytes(8, "big"), b"\x90" * (MAX_BATCH_BYTES + 1)]
    got = take_all(intake, [frames(0, 1, 2, 3, 4), frames(1, 5), heavy, frames(3, 6)])
    assert [d for d in got if isinstance(d, Dropped)] == [
        Dropped("budget_exceeded", 1),
        Dropped("batch_too_heavy", 2),
        Dropped("budget_exceeded", 3),
    ]


def test_an_undecodable_message_is_a_counted_drop():
    intake = KvIntake(max_batches_per_second=0)
    got = take_all(intake, [frames(0, 1), [b"kv", (1).to_bytes(8, "big"), b"\xc1"], frames(2, 2)])
    assert [(type(x).__name__, x.seq) for x in got] == [("Batch", 0), ("Dropped", 1), ("Batch", 2)]
    assert got[1].reason == "parse_error"


def test_token_ids_bound_the_queue_only_when_decoded(kv_frames):
    tokens = KvIntake(max_batches_per_second=0, max_pending_tokens=1, with_tokens=True)
    hashes_only = KvIntake(max_batches_per_second=0, max_pending_tokens=1)
    with_ids = take_all(tokens, kv_frames)
    assert any(isinstance(x, Dropped) and x.reason == "budget_exceeded" for x in with_ids)
    assert all(isinstance(x, Batch) for x in take_all(hashes_only, kv_frames))
