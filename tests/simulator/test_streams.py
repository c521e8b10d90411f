"""Deployment-shape streams without a server decode with the exporter's own decoder."""

import msgspec
import pytest

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.simulator.streams import shape_frames
from kvcache_exporter.sources.kv_events_decode import KvEventDrain, decode_message


@pytest.mark.parametrize(
    ("layout", "groups", "tier"),
    [("llama", 1, 0), ("llama", 1, 40), ("gemma-3", 6, 0), ("deepseek-v4", 6, 0)],
)
def test_streams_decode_and_carry_their_layout(layout, groups, tier):
    frames = shape_frames(layout, 40, num_gpu_blocks=16, lora_adapters=("a",), offload_cpu_blocks=tier)
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
    batches = [decode_message(f, with_tokens=True) for f in frames]
    assert sum(len(e.block_hashes) for b in batches for e in b.events if e.type == "BlockStored") > 0
    raw = [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]
    assert any(e["medium"] == "CPU" for e in raw) == bool(tier)
    stored = [e for e in raw if e["type"] == "BlockStored" and e["medium"] == "GPU"]
    assert len({e["group_idx"] for e in stored}) == groups
    assert {e["lora_name"] for e in stored} == {None, "a"} and all("session_id" in e for e in stored)
    assert any(e["type"] == "BlockRemoved" for e in raw)  # 16 blocks: the traffic evicts
    # The exporter's event view and miss attribution take the whole stream (what they make of it is
    # issue 20's per-group model; here: they read it without a drop).
    drain = KvEventDrain(tuple(batches))
    part = PollState(retention=60).add_kv_events(EventState(), attribution=Attribution())
    part.ingest(drain, 1.0)
    assert part.events.batches == part.attribution.totals.batches == len(frames) and part.events.missed == 0


@pytest.mark.parametrize(("layout", "unit"), [("llama", 16), ("gemma-3", 32), ("deepseek-v4", 256)])
def test_serve_group_model_on_each_shape_learns_the_hit_unit_and_stays_below_what_was_computed(layout, unit):
    engines = []
    frames = shape_frames(layout, 120, num_gpu_blocks=16 if layout == "deepseek-v4" else 64, engines=engines)
    state = PollState(retention=600)
    part = state.add_kv_events(EventState(), attribution=Attribution(), units=UnitView())
    part.ingest(KvEventDrain(tuple(decode_message(f, with_tokens=True) for f in frames)), 1.0)
    assert part.units.hit_unit == unit
    stats = engines[0].stats
    computed = stats.prompt_tokens - stats.prompt_tokens_cached
    attributed = sum(part.attribution.totals.tokens.values())
    assert 0 < attributed <= computed  # misses are tokens vLLM computed, never more
