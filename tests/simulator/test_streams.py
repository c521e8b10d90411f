"""Deployment-shape streams without a server decode with the exporter's own decoder."""

import msgspec
import pytest

from kvcache_exporter.simulator.streams import shape_frames
from kvcache_exporter.sources.kv_events_decode import decode_message


@pytest.mark.parametrize(("layout", "groups"), [("llama", 1), ("gemma-3", 6), ("deepseek-v4", 6)])
def test_streams_decode_and_carry_their_layout(layout, groups):
    frames = shape_frames(layout, 40, num_gpu_blocks=16, lora_adapters=("a",))
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
    batches = [decode_message(f, with_tokens=True) for f in frames]
    assert sum(len(e.block_hashes) for b in batches for e in b.events if e.type == "BlockStored") > 0
    raw = [e for f in frames for e in msgspec.msgpack.decode(f[2])[1]]
    stored = [e for e in raw if e["type"] == "BlockStored"]
    assert len({e["group_idx"] for e in stored}) == groups
    assert {e["lora_name"] for e in stored} == {None, "a"} and all("session_id" in e for e in stored)
    assert any(e["type"] == "BlockRemoved" for e in raw)  # 16 blocks: the traffic evicts
