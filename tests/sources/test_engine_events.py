"""SGLang's and TensorRT-LLM's KV events (sources/engine_events.py): the real SGLang 0.5.23 captures
in ../shared/fixtures/sglang-0.5.23 decoded and folded into attribution, the 0.5.5 array encoding,
and each engine's own rules refusing one event while its batch's others are kept."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import KvEventDrain
from tests.conftest import SHARED_FIXTURES

SGLANG = SHARED_FIXTURES / "sglang-0.5.23"


def captured(name: str) -> list[list[bytes]]:
    """The captured messages as they came off the socket: frames lists ([topic, seq, payload])."""
    out = []
    for message in json.loads((SGLANG / name).read_text()):
        if "payload_hex" in message:
            out.append(
                [
                    message["topic"].encode(),
                    message["seq"].to_bytes(8, "big"),
                    bytes.fromhex(message["payload_hex"]),
                ]
            )
        else:  # a replay reply: [b"", topic, seq, payload] with the end marker last
            parts = [bytes.fromhex(p) for p in message.get("parts_hex", message.get("parts"))]
            if parts[-2] != b"\xff" * 8:
                out.append(parts[1:])
    return out


def fold(messages: list[list[bytes]], engine: str = "sglang") -> KvEventsState:
    state = KvEventsState(
        EventState(), {}, Attribution(), MissHistory(1e9), UnitView(sessions_compute=engine == "sglang")
    )
    for frames in messages:
        state.ingest(KvEventDrain((decode_engine_message(frames, True, engine),)), 1.0)
    return state


def batch(*events: dict, seq: int = 7) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.5, list(events), 0])]


def stored(hashes: list[int], tokens: int | None = None, size: int = 4, **fields) -> dict:
    count = size * len(hashes) if tokens is None else tokens
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None}
    event |= {"token_ids": list(range(10, 10 + count)), "block_size": size, "lora_id": None}
    return event | fields


CAPTURES = [
    "live-kv-frames.json",
    "live-hicache-kv-frames.json",
    "kv-frames.json",
    "kv-frames-dynamo.json",
    "kv-frames-hicache.json",
    "live-kv-replay.json",
    "live-hicache-kv-replay.json",
    "kv-replay.json",
]


@pytest.mark.parametrize("name", CAPTURES)
def test_every_captured_sglang_message_decodes_whole(name):
    messages = captured(name)
    assert messages
    for frames in messages:
        got = decode_engine_message(frames, True, "sglang")
        raw = msgspec.msgpack.decode(frames[-1])
        assert not got.refused
        assert [e.type for e in got.events] == [e["type"] for e in raw[1]]
        assert [list(e.block_hashes) for e in got.events] == [e.get("block_hashes", []) for e in raw[1]]
        assert got.dp_rank == raw[2]


def test_merged_pages_and_media_as_sglang_publishes_them():
    first = decode_engine_message(captured("live-kv-frames.json")[0], True, "sglang").events[0]
    assert (len(first.block_hashes), first.block_size, len(first.token_ids)) == (8, 4, 32)
    assert (first.medium, first.session_id) == ("GPU", "sess-1")
    backup = decode_engine_message(captured("live-hicache-kv-frames.json")[1], True, "sglang").events[0]
    assert backup.medium == "CPU_PINNED"


def test_hicache_lifecycle_backup_is_residency_and_load_back_is_a_tier_hit():
    """kv-frames-hicache.json: GPU store of 16 tokens, CPU_PINNED backup, GPU removal, load-back."""
    state = fold(captured("kv-frames-hicache.json"))
    totals = state.attribution.totals
    assert totals.prompt_miss_tokens == 16  # the first store only: the backup is not computed
    assert totals.tier_restored_tokens == 16
    assert state.units.totals.tier_hit_tokens == {"CPU_PINNED": 16}


def test_live_hicache_tier_hits_equal_sglangs_own_load_back_counter():
    """The real server: five 32-token prompts, then the first again after its pages left the GPU.
    SGLang's /metrics say load_back_tokens_total 28 and cached host 28: the load-back is 7 pages,
    and the 8th page is recomputed (the last token is never a hit), not a miss."""
    metrics = (SGLANG / "live-hicache-metrics.txt").read_text()
    load_back = next(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("sglang:load_back_tokens_total")
    )
    state = fold(captured("live-hicache-kv-frames.json"))
    totals = state.attribution.totals
    assert totals.tier_restored_tokens == load_back == 28
    assert state.units.totals.floor_tokens == 4
    assert totals.prompt_miss_tokens == 5 * 32
    assert totals.tokens["evicted"] == 0


def test_a_vllm_stream_counts_the_same_store_as_a_tier_hit():
    """Without SGLang's session rule the recomputed page reads as loaded (vLLM's model)."""
    state = fold(captured("live-hicache-kv-frames.json"), engine="vllm")
    assert state.attribution.totals.tier_restored_tokens == 32


def test_replay_and_live_frames_fold_to_the_same_attribution():
    """The replay from seq 0 holds the start-up warm-up request too; from the live frames' first on,
    the same attribution."""
    live = captured("live-kv-frames.json")
    first = int.from_bytes(live[0][1], "big")
    replayed = [m for m in captured("live-kv-replay.json") if int.from_bytes(m[1], "big") >= first]
    assert fold(live).attribution.totals.tokens == fold(replayed).attribution.totals.tokens
    assert fold(live).attribution.totals.prompt_miss_tokens == 60


def test_merged_event_whose_tokens_and_hashes_disagree_is_refused_alone():
    good, bad = stored([1, 2]), stored([3, 4, 5], tokens=16)  # more ids than pages: SGLang never
    got = decode_engine_message(batch(good, bad, stored([6])), True, "sglang")
    assert [list(e.block_hashes) for e in got.events] == [[1, 2], [6]]
    assert got.refused == ("invalid_block_size",)
    assert "sglang could not have published it" in got.problem
    # vLLM's windowed groups send more ids than pages: never refused there
    assert not decode_engine_message(batch(stored([3, 4], tokens=12)), True, "vllm").refused
    assert decode_engine_message(batch(stored([3, 4], tokens=12)), True, "sglang").refused


@pytest.mark.parametrize("size", [0, 10**9])
def test_pages_of_zero_or_a_billion_tokens_are_refused(size):
    got = decode_engine_message(batch(stored([1]), stored([2], tokens=4, size=size)), True, "sglang")
    assert [list(e.block_hashes) for e in got.events] == [[1]]
    assert got.refused == ("invalid_block_size",)


@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
def test_unknown_media_are_refused(engine):
    events = [
        stored([1], medium="GPU"),
        stored([2], medium="TAPE"),
        {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"},
    ]
    got = decode_engine_message(batch(*events), True, engine)
    assert [list(e.block_hashes) for e in got.events] == [[1]]
    assert got.refused == ("invalid_event", "invalid_event")
    assert (
        len(decode_engine_message(batch(*events), True, "vllm").events) == 3
    )  # vLLM's connectors name theirs


def test_sglang_0_5_5_tagged_arrays_decode_like_0_5_23_maps():
    """0.5.5's KVCacheEvent was array_like:
    [tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]."""
    as_map = stored([11, 12], medium="CPU_PINNED")
    as_array = ["BlockStored", [11, 12], None, as_map["token_ids"], 4, None, "CPU_PINNED"]
    removed = ["BlockRemoved", [11], "CPU_PINNED"]
    mixed = decode_engine_message(batch(as_map, as_array, removed, ["AllBlocksCleared"]), True, "sglang")
    assert not mixed.refused
    a, b, c, d = mixed.events
    assert (list(a.block_hashes), a.medium, a.block_size, list(a.token_ids)) == (
        list(b.block_hashes),
        b.medium,
        b.block_size,
        list(b.token_ids),
    )
    assert (c.type, list(c.block_hashes), c.medium, d.type) == (
        "BlockRemoved",
        [11],
        "CPU_PINNED",
        "AllBlocksCleared",
    )
    bad_array = ["BlockStored", [11, 12], None, list(range(5)), 4, None, "GPU"]
    assert decode_engine_message(batch(bad_array, as_map), True, "sglang").refused == ("invalid_block_size",)


def test_without_tokens_the_engine_rules_still_apply_and_media_are_kept():
    """The aggregator decodes without token ids: another engine's events still pass its rules."""
    got = decode_engine_message(
        batch(stored([1, 2], medium="CPU_PINNED", session_id="s"), stored([3], tokens=1)), False, "sglang"
    )
    assert got.refused == ("invalid_block_size",)
    (event,) = got.events
    assert (event.type, list(event.block_hashes), event.medium, event.session_id) == (
        "BlockStored",
        [1, 2],
        "CPU_PINNED",
        "s",
    )


def test_the_same_text_under_another_cache_salt_is_identity_isolated():
    """SGLang seeds the hash chain with the salt and names it in the event (vLLM: in extra_keys)."""
    plain = stored(list(range(100, 108)))
    salted = stored(list(range(200, 208)), cache_salt="tenant-b")
    state = fold([batch(plain, seq=0), batch(salted, seq=1)])
    assert state.attribution.totals.tokens["identity_isolated"] == 32
    unsalted = fold([batch(plain, seq=0), batch(stored(list(range(200, 208))), seq=1)])
    assert unsalted.attribution.totals.tokens["identity_isolated"] == 0
