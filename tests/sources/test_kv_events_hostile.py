"""A hostile or broken KV-event publisher (issue 14 item 4): every message is a batch or a parse
error, bounded in bytes, nesting and work, and no sequence number can wreck the counters."""

from __future__ import annotations

import tracemalloc

import msgspec
import pytest

from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.sources.kv_events_decode import (
    MAX_BLOCK_SIZE,
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
    refused = decode_message(frames(msgspec.msgpack.encode([1.0, [stored(b"\xaa" * (64 * 1024))], 0])))
    assert (refused.events, refused.refused) == ((), ("invalid_event",))
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
    poisoned = len(range(0, len(kv_frames), 35))
    # the oversized hash is one bad event: refused, its (otherwise empty) batch kept
    refused = sum(1 for i in range(0, len(kv_frames), 35) if i % len(poisons) == 1)
    assert state.batches == len(kv_frames) + refused
    assert state.dropped["parse_error"] == poisoned - refused
    assert state.dropped["invalid_event"] == refused
    assert state.missed == 0


def stored_with(block_size: int, blocks: int = 2, tokens_per_block: int = 16, **fields) -> dict:
    tokens = list(range(blocks * tokens_per_block))
    hashes = list(range(1, blocks + 1))
    event = {"type": "BlockStored", "block_hashes": hashes, "token_ids": tokens, "block_size": block_size}
    return event | fields


@pytest.mark.parametrize(
    "event",
    [
        stored_with((1 << 64) - 1),  # the issue's: 16 token ids per block, 2^64 - 1 claimed
        stored_with(1_000_000, blocks=1, tokens_per_block=2),  # one 113-byte message, 1e6 cold tokens
        stored_with(17),  # one token more per block than the ids it carries
        stored_with(MAX_BLOCK_SIZE + 1, tokens_per_block=0),  # no token ids: the bound alone
        stored_with(MAX_BLOCK_SIZE, blocks=17, tokens_per_block=0),  # 17 blocks of 65,536: over 1M tokens
    ],
)
def test_a_block_size_the_event_contradicts_is_refused_alone(event):
    good = stored_with(16)
    for with_tokens in (True, False):
        batch = decode_message(frames(msgspec.msgpack.encode([1.0, [good, event, good], 0])), with_tokens)
        if with_tokens:  # the block size is read (and checked) only where a counter multiplies by it
            assert (len(batch.events), batch.refused) == (2, ("invalid_block_size",))
            assert batch.problem.startswith("batch seq 7 event 1: block_size out of bounds")
        else:
            assert (len(batch.events), batch.refused) == (3, ())


@pytest.mark.parametrize(
    "event",
    [
        stored_with(16),
        stored_with(16, tokens_per_block=160),  # a windowed group: the step's ids, more than its blocks
        stored_with(MAX_BLOCK_SIZE, blocks=1, tokens_per_block=0),  # an offload placeholder: no ids
        stored_with(0),  # no block size: read from the ids
    ],
)
def test_block_sizes_vllm_sends_are_kept(event):
    batch = decode_message(frames(msgspec.msgpack.encode([1.0, [event], 0])), with_tokens=True)
    assert (len(batch.events), batch.refused) == (1, ())


@pytest.mark.parametrize(
    "field, value",
    [("group_idx", -1), ("group_idx", 1 << 62), ("lora_name", "x" * 10_000), ("session_id", "s" * 10_000)],
)
def test_one_bad_event_of_200_keeps_the_other_199(field, value):
    events = [stored_with(16, blocks=1) | {"block_hashes": [i]} for i in range(200)]
    events[100] = events[100] | {field: value}
    state = EventState()
    batch = decode_message(frames(msgspec.msgpack.encode([1.0, events, 0])), with_tokens=True)
    state.apply(batch)
    assert len(batch.events) == 199 and 100 not in {e.block_hashes[0] for e in batch.events}
    assert state.dropped == {"invalid_event": 1} and state.batches == 1 and state.cached_blocks == 199
    assert "parse_error" not in state.dropped
