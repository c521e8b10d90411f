"""The simulator's KV events in SGLang's wire shape (simulator/sglang_events.py): every message reads
as SGLang's by SGLang's rules, and the same traffic attributes exactly as in vLLM's shape."""

from __future__ import annotations

import msgspec
import pytest

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.simulator.blocks import NO_ORIGIN, BlockStored, Origin
from kvcache_exporter.simulator.sglang_events import SglangWire
from kvcache_exporter.simulator.streams import shape_frames
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import KvEventDrain


def attribute(frames, kind: str) -> KvEventsState:
    state = KvEventsState(
        EventState(), {}, Attribution(), MissHistory(1e9), UnitView(sessions_compute=kind == "sglang")
    )
    for frames_ in frames:
        batch = decode_engine_message(frames_, True, kind)
        assert not batch.refused, batch.problem
        state.ingest(KvEventDrain((batch,)), 1.0)
    return state


@pytest.mark.parametrize("offload", [0, 256])
def test_sglang_shaped_events_attribute_as_the_same_traffic_in_vllms_shape(offload):
    vllm = attribute(shape_frames(requests=120, offload_cpu_blocks=offload), "vllm")
    frames = shape_frames(requests=120, offload_cpu_blocks=offload, engine_kind="sglang")
    sglang = attribute(frames, "sglang")
    assert sglang.attribution.totals.tokens == vllm.attribution.totals.tokens
    assert sglang.attribution.totals.prompt_miss_tokens > 0
    restored = sglang.attribution.totals.tier_restored_tokens
    assert restored == vllm.attribution.totals.tier_restored_tokens and (restored > 0) == bool(offload)
    media = set()
    for message in frames:
        _ts, events, _rank = msgspec.msgpack.decode(message[-1])
        for event in events:
            assert not {"group_idx", "extra_keys", "kv_cache_spec_kind"} & set(event)
            media.add(event.get("medium"))
            if event["type"] == "BlockStored":
                assert len(event["token_ids"]) == event["block_size"] * len(event["block_hashes"])
                assert "lora_id" in event
                if event["medium"] == "CPU_PINNED":
                    assert "session_id" not in event
    assert media - {None} == ({"GPU", "CPU_PINNED"} if offload else {"GPU"})


def test_consecutive_pages_of_one_chain_are_one_event():
    wire = SglangWire()
    who = Origin(None, None, "s1")
    first = BlockStored([1, 2], None, list(range(8)), 4, origin=who)
    second = BlockStored([3], 2, list(range(8, 12)), 4, origin=who)
    other = BlockStored([9], None, list(range(4)), 4, origin=NO_ORIGIN)
    events = wire.wire([first, second, other])
    assert [e["block_hashes"] for e in events] == [[1, 2, 3], [9]]
    assert events[0]["token_ids"] == list(range(12)) and events[0]["session_id"] == "s1"
    assert "session_id" not in events[1]


def test_a_store_of_host_held_pages_is_a_load_back_without_session():
    wire = SglangWire()
    who = Origin(None, None, "s1")
    gpu = BlockStored([1, 2, 3], None, list(range(12)), 4, origin=who)
    wire.wire([gpu, BlockStored([1, 2], None, [], 0, medium="CPU")])
    back = wire.wire([BlockStored([1, 2, 3], None, list(range(12)), 4, origin=who)])
    assert [(e["block_hashes"], e.get("session_id")) for e in back] == [([1, 2], None), ([3], "s1")]
    assert back[1]["parent_block_hash"] == 2 and back[1]["token_ids"] == [8, 9, 10, 11]
