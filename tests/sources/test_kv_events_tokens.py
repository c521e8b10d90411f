"""Decoding with token ids (for miss attribution): the real frames, and the older array encoding."""

import msgspec

from kvcache_exporter.sources.kv_events_decode import decode_message


def test_real_frames_decode_with_parents_tokens_and_block_size(kv_frames):
    stored = [
        event
        for frames in kv_frames
        for event in decode_message(frames, with_tokens=True).events
        if event.type == "BlockStored"
    ]
    assert len(stored) == 300 and {event.block_size for event in stored} == {32}
    assert all(len(event.token_ids) == 32 * len(event.block_hashes) for event in stored)
    assert sum(event.parent is None for event in stored) > 0 and sum(e.parent is not None for e in stored) > 0
    plain = [e for f in kv_frames for e in decode_message(f).events if e.type == "BlockStored"]
    assert [list(e.block_hashes) for e in plain] == [e.block_hashes for e in stored]


def test_array_tagged_events_decode_with_tokens_too():
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [1, 2], 9, list(range(32)), 16], ["BlockRemoved", [1]], ["AllBlocksCleared"]]]
    )
    events = decode_message([(5).to_bytes(8, "big"), payload], with_tokens=True).events
    assert [e.type for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert (events[0].parent, events[0].block_size, len(events[0].token_ids)) == (9, 16, 32)
    assert list(events[2].block_hashes) == []
