"""The group model's counts as samples: one series per group, bounded adapter and session labels,
the session share only once something was stored, tier bytes only with a known block size."""

from kvcache_exporter.derive.unit_samples import unit_samples
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.kv_events_decode import Batch, Event


def by_name(samples):
    out = {}
    for s in samples:
        out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def test_an_empty_view_exports_zeros_and_no_ratio():
    got = by_name(unit_samples(UnitView()))
    assert got["kvcache_kv_events_stored_tokens_total"] == {(("adapter", "base"),): 0}
    assert "kvcache_kv_events_session_id_ratio" not in got
    assert "kvcache_kv_events_hit_unit_tokens" not in got


def test_groups_adapters_sessions_and_tiers():
    view = UnitView(label_limit=1)
    events = (
        Event("BlockStored", [1, 2], None, [5] * 64, 32, group=1, kind="full_attention", session_id="s"),
        Event("BlockStored", [2], None, [5] * 64, 32, group=0, kind="sliding_window", window=64),
        Event("BlockStored", [3], 2, [6] * 32, 32, lora_name="a", group=1, kind="full_attention"),
        Event("BlockStored", [4], 3, [7] * 32, 32, lora_name="b", group=1, kind="full_attention"),
        Event("BlockStored", [9], None, [], 32, medium="CPU"),
    )
    view.units(Batch(0, 1.0, events))
    got = by_name(unit_samples(view, block_bytes=1000.0))
    assert set(got["kvcache_kv_events_group_info"]) == {
        (("block_size", "32"), ("group", "0"), ("kind", "sliding_window"), ("sliding_window", "64")),
        (("block_size", "32"), ("group", "1"), ("kind", "full_attention"), ("sliding_window", "")),
    }
    assert got["kvcache_kv_events_hit_unit_tokens"] == {(): 32}
    assert got["kvcache_kv_events_stored_tokens_total"] == {
        (("adapter", "base"),): 64,
        (("adapter", "other"),): 64,
    }
    assert got["kvcache_kv_events_session_id_ratio"] == {(): 0.5}
    assert got["kvcache_kv_events_tier_blocks"] == {(("medium", "CPU"),): 1}
    assert got["kvcache_kv_events_tier_bytes"] == {(("medium", "CPU"),): 1000.0}
    assert "kvcache_kv_events_tier_bytes" not in by_name(unit_samples(view))
