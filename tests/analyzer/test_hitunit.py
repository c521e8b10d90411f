"""The hit unit's cost, checked against the exact replay with a pool nothing is evicted from."""

from __future__ import annotations

import random

from kvcache_exporter.analyzer import blocktrace, hitunit, mrc, trace

from .traces import mooncake_lines


def shared_template_trace(template: int, seed: int = 3) -> list[trace.TraceRequest]:
    rng = random.Random(seed)
    shared = [rng.randint(5, 500) for _ in range(template)]
    return [
        trace.TraceRequest([*shared, *(rng.randint(5, 500) for _ in range(40))], 8, index=n)
        for n in range(30)
    ]


def test_a_361_token_template_at_units_of_16_to_256():
    """DeepSeek-V4's case: of a 361-token shared template 256-token units hit 256, 32-token ones 352."""
    traces = shared_template_trace(361)
    ids = blocktrace.Interner()
    rows = hitunit.unit_rows([blocktrace.from_tokens(t, 16, ids) for t in traces], traces, 16, None)
    by_unit = {row["unit"]: row for row in rows}
    assert [row["unit"] for row in rows] == [16, 32, 64, 128, 256]
    for unit, row in by_unit.items():
        assert row["hit_tokens"] == 29 * (361 // unit * unit)  # every request but the first
        ids = blocktrace.Interner()
        exact = mrc.pool_replay([blocktrace.from_tokens(t, unit, ids) for t in traces], unit, 800)
        assert row["hit_tokens"] == exact.hit_tokens
    assert by_unit[256]["lost_tokens"] == 29 * (352 - 256)
    assert by_unit[16]["lost_tokens"] == 0


def test_hash_traces_at_the_units_dividing_their_block():
    lines = mooncake_lines(200)
    parsed = blocktrace.parse_lines(lines, "day", 16)
    rows = hitunit.unit_rows(parsed.requests, [], 16, 512, replicas=2)
    assert [row["unit"] for row in rows] == [16, 32, 64, 128, 256]
    for row in rows:
        chains = blocktrace.parse_lines(lines, "day", row["unit"]).requests
        unbounded = sum(blocktrace.total_blocks(r, row["unit"]) for r in chains) + 2
        exact = mrc.pool_replay(chains, row["unit"], unbounded, replicas=2)
        assert row["hit_tokens"] == exact.hit_tokens
    assert rows[0]["hit_tokens"] >= rows[-1]["hit_tokens"] > 0
