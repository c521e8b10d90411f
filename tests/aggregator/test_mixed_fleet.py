"""A pool of vLLM and SGLang replicas in one `aggregate`: each engine's hashes are its own (never a
block of another engine), HiCache's host copies are not GPU residency, and a replica's engine comes
from --replica or a file_sd label. The SGLang streams are the real 0.5.23 captures."""

from __future__ import annotations

import json

import pytest

from kvcache_exporter.aggregator.discovery import parse_file_sd, parse_flag
from kvcache_exporter.aggregator.fleet_residency import FleetResidency
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import Batch, Event
from tests.conftest import SHARED_FIXTURES

SGLANG = SHARED_FIXTURES / "sglang-0.5.23"


def stored(*hashes, medium=None):
    return Event("BlockStored", tuple(hashes), medium=medium)


def batch(seq, *events):
    return Batch(seq, 0.0, tuple(events))


def sglang_batches(name: str) -> list[Batch]:
    """A capture decoded as the aggregator decodes it: without token ids, the engine's rules on."""
    out = []
    for message in json.loads((SGLANG / name).read_text()):
        frames = [b"kv", message["seq"].to_bytes(8, "big"), bytes.fromhex(message["payload_hex"])]
        out.append(decode_engine_message(frames, engine="sglang"))
    return out


def test_the_same_hash_on_two_engines_is_never_shared():
    fleet = FleetResidency()
    fleet.add_replica("v", "vllm")
    fleet.add_replica("s", "sglang")
    fleet.apply("v", batch(0, stored(1, 2, 3)))
    fleet.apply("s", batch(0, stored(1, 2, 3)))
    v, s = fleet.replicas["v"], fleet.replicas["s"]
    assert (v.other_replica, s.other_replica, fleet.duplicates, fleet.distinct) == (0, 0, 0, 6)
    assert (v.resident, s.resident) == (3, 3)
    fleet.apply("s", batch(1, Event("BlockRemoved", (1,))))
    assert (v.resident, s.resident, fleet.distinct) == (3, 2, 5)  # vLLM's block 1 stays


def test_two_replicas_of_one_engine_still_share():
    fleet = FleetResidency()
    for name in ("s1", "s2"):
        fleet.add_replica(name, "sglang")
    fleet.apply("s1", batch(0, stored(7, 8)))
    fleet.apply("s2", batch(0, stored(8, 9)))
    assert (fleet.replicas["s2"].other_replica, fleet.duplicates) == (1, 1)


def test_hicache_host_copies_are_not_gpu_residency():
    """The live HiCache run: every GPU store is backed up as CPU_PINNED and the host copies later
    evicted; the pool view follows the GPU only."""
    gpu = FleetResidency()
    gpu.add_replica("s", "sglang")
    for each in sglang_batches("live-hicache-kv-frames.json"):
        gpu.apply("s", each)
        if any(e.type == "AllBlocksCleared" for e in each.events):
            break
        held = set()
        for e in (
            e for b in sglang_batches("live-hicache-kv-frames.json") if b.seq <= each.seq for e in b.events
        ):
            if e.medium == "GPU" and e.type == "BlockStored":
                held.update(e.block_hashes)
            elif e.medium == "GPU" and e.type == "BlockRemoved":
                held.difference_update(e.block_hashes)
        assert gpu.replicas["s"].resident == len(held)
    assert gpu.replicas["s"].stored == sum(
        len(e.block_hashes)
        for b in sglang_batches("live-hicache-kv-frames.json")
        for e in b.events
        if e.type == "BlockStored" and e.medium == "GPU"
    )


def test_a_replicas_engine_comes_from_the_flag_or_a_file_sd_label():
    assert parse_flag("b:30000,tcp://b:5557,sglang", None).engine == "sglang"
    assert parse_flag("a:8000", 5557).engine == "vllm"
    sd = json.dumps([{"targets": ["c:30000"], "labels": {"engine": "trtllm"}}, {"targets": ["d:8000"]}])
    assert [r.engine for r in parse_file_sd(sd, 5557)] == ["trtllm", "vllm"]
    with pytest.raises(ValueError, match="engine 'tgi'"):
        parse_flag("b:30000,tcp://b:5557,tgi", None)
