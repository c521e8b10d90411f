"""Append-only turns on a hybrid layout (DeepSeek-V4's 256-token hit unit), as the real vLLM stores
them: a turn that adds one unit is one anchor block behind the last prompt's open tip, just like
decode filling that block; the window groups tell them apart. Each test fails without its rule."""

from __future__ import annotations

from kvcache_exporter.derive.attribution import CAUSES
from kvcache_exporter.sources.kv_events_decode import Event
from tests.derive.test_units import DSV4, Chain, feed, part, unit_events, words

FAULTS = set(CAUSES) - {"cold"}


def decode_events(chain: Chain, start: int, unit: int) -> list[Event]:
    """Decode completing [start, start + unit): the window and state groups with empty hash lists,
    the anchor group the unit's block behind the chain (as the real DeepSeek-V4 CPU run sends it)."""
    tokens, end = chain.tokens[start : start + unit], chain.at[start + unit]
    events = []
    for group, (kind, window, size) in DSV4.items():
        hashes, parent = ([end], chain.at[start]) if window is None else ([], None)
        fields = {"group": group, "kind": kind, "window": window}
        events.append(Event("BlockStored", hashes, parent, tokens, size, **fields))
    return events


def test_a_turn_one_unit_long_is_a_prompt_miss_not_decode():
    """A 300-token prompt stores its first unit (its open tip); the next turn, 569 tokens, hits it and
    stores one unit behind it in one prefill step, its window groups naming that unit: `cold`, not
    decode (before: all 256 tokens read as decode, the turn as `decode`)."""
    state, chain = part(), Chain(words(569, 11))
    feed(state, unit_events(DSV4, chain, 0, 256))
    feed(state, unit_events(DSV4, chain, 256, 256))
    totals = state.attribution.totals
    assert totals.decode_tokens == 0
    assert totals.tokens["cold"] == 512 and totals.prompt_miss_tokens == 512


def test_decode_filling_a_unit_is_still_decode():
    state, chain = part(), Chain(words(512, 12))
    feed(state, unit_events(DSV4, chain, 0, 256))
    feed(state, decode_events(chain, 256, 256))
    totals = state.attribution.totals
    assert totals.decode_tokens == 256 and totals.prompt_miss_tokens == 256


def test_an_append_to_an_open_tip_is_never_a_fault():
    """A turn appended to a chain's open tip hit the whole chain, and nothing was held past it: no
    hit was lost, whatever content it carries. Here its new unit starts with 150 tokens another chain
    stored (a document quoted again): before, `below_hit_unit` (known content short of a unit at the
    divergence point)."""
    state = part()
    other = Chain(words(256, 13))
    feed(state, unit_events(DSV4, other, 0, 256))
    mine = words(300, 14)
    chain = Chain(mine + other.tokens[:150] + words(120, 15))
    feed(state, unit_events(DSV4, chain, 0, 256))
    feed(state, unit_events(DSV4, chain, 256, 256))
    tokens = state.attribution.totals.tokens
    assert not {cause: n for cause, n in tokens.items() if n and cause in FAULTS}
    assert tokens["cold"] == 3 * 256


def test_a_field_in_the_second_unit_of_a_root_stored_again_is_prefix_diverged():
    """A field 61 tokens into the second unit, the rest as before: the hybrid root is stored again
    over its first (resident) unit, and the three units behind it hold only known content in order,
    no anchor on the field. 512 tokens in order past the field read as a field even where 4 hit
    units (1,024 tokens here) are not reached: before, `cold` 100 %."""
    for seed in range(20, 30):  # seeds 21 and 22: no anchor on the field
        before, field = words(1100, seed), words(10, seed + 100)
        after = before[:317] + field + before[327:]
        state = part()
        feed(state, unit_events(DSV4, Chain(before), 0, 1024))
        feed(state, unit_events(DSV4, Chain(after), 0, 1024))
        tokens = state.attribution.totals.tokens
        assert tokens["prefix_diverged"] >= 768 and tokens["cold"] <= 1024 + 256, (seed, tokens)
