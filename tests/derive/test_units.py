"""The group model on hand-built streams laid out as vLLM 0.32 lays them out (DeepSeek-V4: 6 groups,
one 256-token unit = 25 hashes; Gemma-3: 5 sliding groups and a full one), then through attribution."""

from __future__ import annotations

import random

import msgspec

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.kv_events_decode import Batch, Event, KvEventDrain

# group -> (kind, window, block size), as the DeepSeek-V4 capture announces them
DSV4 = {
    0: ("sliding_window_mla", 128, 64),
    1: ("sliding_window_mla", 128, 64),
    2: ("sliding_window_mla", 128, 64),
    3: ("mla_attention", None, 256),
    4: ("sliding_window_mla", 8, 4),
    5: ("sliding_window_mla", 128, 8),
}
GEMMA3 = {g: ("sliding_window", 64, 32) for g in range(5)} | {5: ("full_attention", None, 32)}


class Chain:
    """Chain hashes at every 4 tokens of one prompt (vLLM's hash block on DeepSeek-V4): a block's hash is
    the chain hash at its end, so one value appears in several groups."""

    def __init__(self, tokens: list[int], salt: int = 0):
        self.tokens = tokens
        self.at = {
            end: hash((salt, tuple(tokens[:end]))) & (2**64 - 1) for end in range(4, len(tokens) + 1, 4)
        }


def unit_events(layout, chain: Chain, start: int, unit: int, **fields) -> list[Event]:
    """The stores of one prefill step computing [start, start + unit): each group its in-window blocks
    (full groups: all), windowed groups with a null parent and all the step's token ids."""
    events = []
    tokens = chain.tokens[start : start + unit]
    for group, (kind, window, size) in layout.items():
        ends = range(start + size, start + unit + 1, size)
        if window is not None:
            ends = [e for e in ends if e > start + unit - window]
        parent = chain.at[start] if window is None and start else None
        hashes = [chain.at[e] for e in ends]
        events.append(
            Event(
                "BlockStored", hashes, parent, tokens, size, group=group, kind=kind, window=window, **fields
            )
        )
    return events


def words(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 50_000) for _ in range(n)]


def part() -> KvEventsState:
    return KvEventsState(EventState(), {}, Attribution(), MissHistory(1e9), UnitView())


def feed(state: KvEventsState, *batches: list[Event]) -> None:
    for events in batches:
        seq = state.events.cursor.next or 0
        state.ingest(KvEventDrain((Batch(seq, 1.0, tuple(events)),)), 1.0)


def test_a_deepseek_v4_unit_is_counted_once_not_25_times():
    state, chain = part(), Chain(words(512, 1))
    feed(state, unit_events(DSV4, chain, 0, 512))
    assert sum(len(e.block_hashes) for e in unit_events(DSV4, chain, 0, 256)) == 25
    assert state.attribution.totals.prompt_miss_tokens == 512
    assert state.units.hit_unit == 256
    assert state.units.anchor == 3


def test_window_and_state_removals_of_a_held_unit_are_window_expiries_of_its_hit():
    state, chain = part(), Chain(words(256, 2))
    first = unit_events(DSV4, chain, 0, 256)
    feed(state, first)
    state_block = first[4].block_hashes[0]  # group 4 (block 4, window 8): needed to hit at 256
    feed(state, [Event("BlockRemoved", [state_block], group=4)])
    assert state.units.totals.window_evictions == 1
    feed(state, unit_events(DSV4, chain, 0, 256))  # recomputed: the full group still held it
    assert state.attribution.totals.tokens["window_expired"] == 256  # not a capacity eviction
    assert state.attribution.totals.tokens["evicted"] == 0


def test_removals_of_blocks_no_hit_needs_are_not_evictions():
    state, chain = part(), Chain(words(256, 3))
    feed(state, unit_events(DSV4, chain, 0, 256))
    feed(state, [Event("BlockRemoved", [12345], group=0), Event("BlockRemoved", [], group=5)])
    feed(state, unit_events(DSV4, chain, 0, 256))
    assert state.units.totals.window_evictions == 0
    assert state.attribution.totals.tokens["evicted"] == 0


def test_empty_hash_lists_null_parents_and_several_block_sizes_in_one_group():
    state, chain = part(), Chain(words(512, 4))
    events = unit_events(DSV4, chain, 0, 256)
    decode = [Event("BlockStored", [], None, [], 64, group=0, kind="sliding_window_mla", window=128)]
    small = [
        Event(
            "BlockStored",
            [chain.at[260]],
            chain.at[256],
            chain.tokens[256:260],
            4,
            group=3,
            kind="mla_attention",
        )
    ]
    feed(state, events, decode, small)
    assert state.units.groups[3].block_sizes == {4, 256}
    assert state.units.hit_unit == 256
    assert state.attribution.totals.prompt_miss_tokens + state.attribution.totals.decode_tokens == 256 + 4


def test_gemma3_every_store_sent_once_per_group():
    state, chain = part(), Chain(words(320, 5))
    feed(state, unit_events({g: (k, w, 32) for g, (k, w, _) in GEMMA3.items()}, chain, 0, 320))
    assert state.attribution.totals.prompt_miss_tokens == 320
    assert state.units.anchor == 5 and state.units.hit_unit == 32
    # the sliding groups' removal of blocks the full group holds, outside their window: nothing
    feed(state, [Event("BlockRemoved", [chain.at[32]], group=g) for g in range(5)])
    assert state.units.totals.window_evictions == 0
    # ...inside the window the last unit's hit needs: the unit is no longer hittable
    feed(state, [Event("BlockRemoved", [chain.at[320]], group=0)])
    assert state.units.totals.window_evictions == 1


def test_header_first_reads_prefix_diverged_per_unit():
    state, template = part(), words(1024, 6)
    for i in range(6):
        chain = Chain(words(16, 100 + i) + template[:-16])
        feed(state, unit_events(DSV4, chain, 0, 1024))
    tokens = state.attribution.totals.tokens
    assert tokens["prefix_diverged"] >= 0.75 * sum(tokens.values())
    assert sum(tokens.values()) == 6 * 1024


def test_reuse_reports_are_hits_not_misses():
    state, chain = part(), Chain(words(512, 7))
    feed(state, unit_events(DSV4, chain, 0, 512))
    report = [e._replace(parent=None, session_id="s1") for e in unit_events(DSV4, chain, 0, 256)]
    feed(state, report)
    assert state.units.totals.reused_tokens == 256
    assert state.units.reused_by_session.counts == {"s1": 256}
    assert state.attribution.totals.prompt_miss_tokens == 512


def test_an_offloaded_unit_loaded_back_is_a_tier_hit():
    state, chain = part(), Chain(words(256, 8))
    gpu = unit_events(DSV4, chain, 0, 256)
    feed(state, gpu)
    anchor = gpu[3].block_hashes
    feed(state, [Event("BlockStored", anchor, None, [], 256, medium="CPU")])
    feed(state, [Event("BlockRemoved", anchor, group=3)])  # evicted from the GPU, still on the CPU
    feed(state, gpu)  # loaded back
    assert state.units.totals.tier_hit_tokens == {"CPU": 256}
    assert state.attribution.totals.prompt_miss_tokens == 256  # only the first computation
    assert len(state.units.tiers["CPU"]) == 1
    feed(state, [Event("BlockRemoved", anchor, medium="CPU")])
    assert len(state.units.tiers["CPU"]) == 0


def test_lora_and_cache_salt_are_part_of_the_identity():
    text = words(256, 9)
    state = part()
    feed(state, unit_events(DSV4, Chain(text), 0, 256))
    feed(state, unit_events(DSV4, Chain(text, salt=1), 0, 256, lora_name="adapter-a"))
    salt = msgspec.msgpack.encode([["tenant-a"], None])
    feed(state, unit_events(DSV4, Chain(text, salt=2), 0, 256, extra_keys=salt))
    tokens = state.attribution.totals.tokens
    assert tokens["prefix_diverged"] == 0 and tokens["cold"] == 256  # three identities, each computed
    assert tokens["identity_isolated"] == 2 * 256  # the same text held under another identity: by design
    assert state.units.by_adapter.counts == {"base": 512, "adapter-a": 256}


def test_adapter_labels_are_bounded():
    view = UnitView(label_limit=2)
    for name in ("a", "b", "c", "d"):
        view.by_adapter.add(name, 1)
    assert view.by_adapter.counts == {"a": 1, "b": 1, "other": 2}


def test_bounded_memory_whatever_the_stream():
    view = UnitView(max_blocks=100)
    for i in range(50):
        chain = Chain(words(256, 1000 + i))
        view.units(Batch(i, 1.0, tuple(unit_events(DSV4, chain, 0, 256))))
    assert len(view.resident) <= 100 and view.parts <= 100


def test_a_restart_forgets_every_tier():
    state, chain = part(), Chain(words(256, 10))
    feed(state, unit_events(DSV4, chain, 0, 256), [Event("BlockStored", [1], None, [], 256, medium="CPU")])
    state.ingest(KvEventDrain((Batch(0, 1.0, ()),)), 2.0)  # seq back to 0: a new publisher
    assert not state.units.resident and not state.units.tiers and not state.units.groups
    feed(state, unit_events(GEMMA3, Chain(words(64, 11)), 0, 64))  # another model behind the endpoint
    assert state.units.anchor == 5 and state.units.hit_unit == 32
    assert state.events.restarts == 1


def test_a_hostile_stream_cannot_grow_groups_sizes_or_tiers_without_bound():
    view = UnitView()
    events = [
        Event("BlockStored", [i], None, [], 16 + i % 100, group=i % 5000, kind="k") for i in range(20_000)
    ]
    events += [Event("BlockStored", [i], None, [], 16, medium=f"T{i}") for i in range(100)]
    view.units(Batch(0, 1.0, tuple(events)))
    assert len(view.groups) <= 64 and all(len(g.block_sizes) <= 8 for g in view.groups.values())
    assert len(view.tiers) <= 8 and "other" in view.tiers


def test_an_sglang_flush_clears_the_host_tier_a_vllm_reset_does_not():
    """SGLang's /flush_cache (AllBlocksCleared) resets HiCache's host pool too: a real SGLang 0.5.23
    recomputed a flushed prompt whole (its cached_tokens unchanged), so it is a miss, not a tier hit."""
    hashes = [hash(("p", i)) for i in range(8)]
    for sglang, hit in ((True, 0), (False, 32)):
        state = KvEventsState(
            EventState(), {}, Attribution(), MissHistory(1e9), UnitView(sessions_compute=sglang)
        )
        stored = Event("BlockStored", hashes, None, list(range(32)), 4)
        feed(state, [stored], [Event("BlockStored", hashes, None, list(range(32)), 4, medium="CPU_PINNED")])
        feed(state, [Event("AllBlocksCleared", [])], [stored])
        assert sum(state.units.totals.tier_hit_tokens.values()) == hit, sglang
        assert state.attribution.totals.prompt_miss_tokens == 64 - hit, sglang
