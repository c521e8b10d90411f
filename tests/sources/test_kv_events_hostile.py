"""A hostile or broken KV-event publisher (issue 14 item 4): every message is a batch or a parse
error, bounded in bytes, nesting and work, and no sequence number can wreck the counters."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest

from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.sources.kv_events_decode import (
    MAX_EVENTS_PER_BATCH,
    MAX_HASH_BYTES,
    MAX_SEQ_GAP,
    KvEventDecodeError,
    decode_message,
)


def frames(payload: bytes, seq: int = 7) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), payload]


def stored(*hashes) -> dict:
    return {"type": "BlockStored", "block_hashes": list(hashes)}


def parse_error(payload: bytes) -> KvEventDecodeError:
    with pytest.raises(KvEventDecodeError) as caught:
        decode_message(frames(payload))
    assert caught.value.reason == "parse_error" and caught.value.seq == 7
    return caught.value


def test_oversized_byte_hashes_are_refused():
    parse_error(msgspec.msgpack.encode([1.0, [stored(b"\xaa" * (64 * 1024))], 0]))
    ok = decode_message(frames(msgspec.msgpack.encode([1.0, [stored(b"\xaa" * MAX_HASH_BYTES)], 0])))
    assert ok.events[0].block_hashes == (b"\xaa" * MAX_HASH_BYTES,)


def test_millions_of_empty_arrays_cost_one_type_check_not_a_gigabyte():
    count = 4_000_000  # within MAX_BATCH_BYTES, so the decoder itself meets them
    payload = b"\x93\xcb" + bytes(8) + b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count + b"\x00"
    tracemalloc.start()
    parse_error(payload)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # nothing per element was built


def test_too_many_events_are_refused_from_the_header():
    cleared = {"type": "AllBlocksCleared"}
    parse_error(msgspec.msgpack.encode([1.0, [cleared] * (MAX_EVENTS_PER_BATCH + 1), 0]))
    # the per-event (slow) path has the same bound
    parse_error(
        msgspec.msgpack.encode({"ts": 1.0, "events": [["AllBlocksCleared"]] * (MAX_EVENTS_PER_BATCH + 1)})
    )


@pytest.mark.parametrize("where", ["unknown_field", "array_event", "hashes"])
def test_deep_nesting_is_a_parse_error_not_a_recursion_crash(where):
    deep = b"\x91" * 100_000 + b"\x00"
    head = {
        "unknown_field": msgspec.msgpack.encode(
            [1.0, [{"type": "BlockStored", "block_hashes": [1], "x": 0}]]
        ),
        "array_event": msgspec.msgpack.encode([1.0, [["BlockPinned", 0]]]),
        "hashes": msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": 0}]]),
    }[where]
    parse_error(head[:-1] + deep)  # the last 0 of each becomes 100k nested arrays


def test_a_seq_far_ahead_is_a_new_publisher_not_a_quintillion_lost_batches():
    state = EventState()
    state.apply(decode_message(frames(msgspec.msgpack.encode([1.0, [stored(1)]]), seq=10)))
    for jump in (1 << 60, (1 << 63) + 5, (1 << 64) - 10):
        state.apply(decode_message(frames(msgspec.msgpack.encode([1.0, [stored(2)]]), seq=jump)))
    assert state.missed == 0
    assert state.restarts == 3
    assert state.cached_blocks == 1  # each jump reset the view; only the last batch's block is held
    state.apply(decode_message(frames(msgspec.msgpack.encode([1.0, []]), seq=(1 << 64) - 6)))
    assert state.missed == 3  # an ordinary gap after the jump is still counted exactly


def test_a_gap_up_to_the_bound_is_counted_and_beyond_it_is_a_reset():
    state = EventState()
    state.apply(decode_message(frames(msgspec.msgpack.encode([1.0, []]), seq=0)))
    state.apply(decode_message(frames(msgspec.msgpack.encode([1.0, []]), seq=1 + MAX_SEQ_GAP)))
    assert (state.missed, state.restarts) == (MAX_SEQ_GAP, 0)
    state.apply(decode_message(frames(msgspec.msgpack.encode([1.0, []]), seq=3 + 2 * MAX_SEQ_GAP)))
    assert (state.missed, state.restarts) == (MAX_SEQ_GAP, 1)


def test_backwards_seqs_log_once_a_minute(caplog):
    now = [0.0]
    state = EventState(clock=lambda: now[0])
    batch = [1.0, []]
    caplog.set_level("INFO")
    for i in range(200):  # a publisher flipping between two seqs, each a reset
        state.apply(decode_message(frames(msgspec.msgpack.encode(batch), seq=1 << 40 if i % 2 else 0)))
    assert (state.restarts, state.missed) == (199, 0)
    assert sum("jumped" in r.message for r in caplog.records) == 1
    now[0] = 61.0
    state.apply(decode_message(frames(msgspec.msgpack.encode(batch), seq=0)))
    assert sum("jumped" in r.message for r in caplog.records) == 2


def test_poisons_among_valid_batches_lose_none_of_the_valid_ones(kv_frames):
    poisons = [
        b"\xc1",
        msgspec.msgpack.encode([1.0, [stored(b"\x00" * 100_000)]]),
        msgspec.msgpack.encode([1.0, [["BlockPinned", 0]]])[:-1] + b"\x91" * 50_000 + b"\x00",
        msgspec.msgpack.encode({"ts": "x", "events": []}),
    ]
    state = EventState()
    seq = 0
    for i, (_topic, _seq, payload) in enumerate(kv_frames):
        for message in [payload, poisons[i % len(poisons)]] if i % 35 == 0 else [payload]:
            try:
                state.apply(decode_message(frames(message, seq)))
            except KvEventDecodeError as err:
                state.drop(err.reason, err.seq)
            seq += 1
    assert state.batches == len(kv_frames)
    assert state.dropped["parse_error"] == len(range(0, len(kv_frames), 35))
    assert state.missed == 0
