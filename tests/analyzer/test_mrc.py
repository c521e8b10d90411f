"""The one-pass miss-ratio curve against exact replays through the simulator's block pool."""

from __future__ import annotations

import pytest

from kvcache_exporter.analyzer import blocktrace, mrc, trace
from kvcache_exporter.analyzer.replay import replay

from .traces import mooncake_lines


def seed_blocks(seed_trace_path, block_size):
    lines = seed_trace_path.read_text().splitlines()
    return lines, blocktrace.parse_lines(lines, "seed", block_size)


def worst_error(requests, block_size, num_gpu_blocks, **kw) -> tuple[float, int]:
    curve = mrc.stack_curve(requests, block_size, num_gpu_blocks, **kw)
    errors = [
        abs(mrc.pool_replay(requests, block_size, size, **kw).hit_ratio - curve.ratio(hits))
        for size, hits in zip(curve.sizes, curve.hit_tokens, strict=True)
        if size >= curve.fits_from
    ]
    return max(errors), len(errors)


def test_pool_replay_is_the_engine_replay_request_for_request(seed_trace_path):
    lines, parsed = seed_blocks(seed_trace_path, 16)
    engine = replay(trace.parse_trace(lines), 16, 64)
    pool = mrc.pool_replay(parsed.requests, 16, 64)
    assert pool.per_request_hits == engine.per_request_hits
    assert 0.3 < pool.hit_ratio == engine.hit_ratio < 0.5  # the cache is small enough to evict


@pytest.mark.parametrize("block_size,num_gpu_blocks", [(16, 64), (32, 96)])
def test_curve_matches_exact_replays_on_the_seed(seed_trace_path, block_size, num_gpu_blocks):
    _, parsed = seed_blocks(seed_trace_path, block_size)
    error, points = worst_error(parsed.requests, block_size, num_gpu_blocks)
    assert points >= 10 and error <= 0.01
    curve = mrc.stack_curve(parsed.requests, block_size, num_gpu_blocks)
    exact = mrc.pool_replay(parsed.requests, block_size, num_gpu_blocks)
    assert curve.observed_hit_tokens == exact.hit_tokens


@pytest.mark.parametrize("block_size", [16, 128, 512])
def test_curve_matches_exact_replays_on_a_mooncake_trace(block_size):
    parsed = blocktrace.parse_lines(mooncake_lines(300), "gen", block_size)
    assert parsed.kind == "mooncake" and not parsed.skipped
    num_gpu_blocks = 2000 * 16 // block_size
    error, points = worst_error(parsed.requests, block_size, num_gpu_blocks)
    assert points >= 9 and error <= 0.001
    curve = mrc.stack_curve(parsed.requests, block_size, num_gpu_blocks)
    ratios = [curve.ratio(h) for h in curve.hit_tokens]
    assert ratios == sorted(ratios) and ratios[-1] - ratios[0] > 0.1  # the sizes matter on this trace
    assert curve.misses_by_cause["evicted"] > 0 and curve.misses_by_cause["cold"] > 0


def test_restarts_and_replicas_match_exact_replays():
    parsed = blocktrace.parse_lines(mooncake_lines(300, seed=2, instances=3), "gen", 64)
    error, _ = worst_error(parsed.requests, 64, 250)
    assert error <= 0.001
    curve = mrc.stack_curve(parsed.requests, 64, 250)
    assert curve.restarts == 2 and curve.misses_by_cause["restart"] > 0
    steady = mrc.stack_curve(blocktrace.parse_lines(mooncake_lines(300, seed=2), "g", 64).requests, 64, 250)
    assert curve.unbounded_hit_tokens < steady.unbounded_hit_tokens
    error, _ = worst_error(parsed.requests, 64, 250, replicas=2)
    assert error <= 0.001
    spread = mrc.stack_curve(parsed.requests, 64, 250, replicas=2)
    assert spread.misses_by_cause["other_replica"] > 0


def test_hash_trace_requests_stay_block_ids():
    lines = mooncake_lines(50)
    parsed = blocktrace.parse_lines(lines, "gen", 16)
    first = parsed.requests[0]
    assert first.prompt_tokens > 0 and all(isinstance(g, int) for g in first.groups)
    assert sum(len(r.groups) for r in parsed.requests) == sum(line.count(",") for line in lines) - 100
    assert all(w <= 32 for r in parsed.requests for w in r.widths)


def test_bad_lines_are_named_and_skipped():
    lines = [
        mooncake_lines(1)[0],
        "{not json",
        '{"hash_ids": [], "input_length": 5}',
        '{"hash_ids": [1, 2], "input_length": 5000}',
        "[1, 2]",
    ]
    parsed = blocktrace.parse_lines(lines, "day.jsonl", 16)
    assert len(parsed.requests) == 1
    assert [s.split(":")[1] for s in parsed.skipped] == ["2", "3", "4", "5"]
    assert parsed.skipped[2] == "day.jsonl:4: input_length 5000 does not match 2 blocks of 512"


def test_qwen_turns_share_their_conversation():
    lines = [
        '{"chat_id": 1, "parent_chat_id": -1, "turn": 1, "timestamp": 0.5, "input_length": 40, '
        '"output_length": 8, "hash_ids": [11, 12, 13]}',
        '{"chat_id": 2, "parent_chat_id": 1, "turn": 2, "timestamp": 1.5, "input_length": 70, '
        '"output_length": 8, "hash_ids": [11, 12, 13, 14, 15]}',
    ]
    parsed = blocktrace.parse_lines(lines, "qwen", 16)
    assert parsed.kind == "qwen"
    assert [r.session for r in parsed.requests] == ["1", "1"]
    assert [r.widths for r in parsed.requests] == [[1, 1, 0], [1, 1, 1, 1, 0]]
    curve = mrc.stack_curve(parsed.requests, 16, 64)
    assert curve.observed_hit_tokens == 32  # blocks 11 and 12; 13 was partial in turn 1, so never cached


@pytest.mark.parametrize("kw", [{}, {"replicas": 2}, {"restart_at": (100, 200)}])
def test_unbounded_is_the_exact_replay_with_no_eviction(kw):
    """A later, shorter use of a trace block must not hide its longer earlier use (still cached)."""
    from .traces import qwen_lines

    for lines in (mooncake_lines(300), qwen_lines(150)):
        requests = blocktrace.parse_lines(lines, "gen", 16).requests
        big = sum(blocktrace.total_blocks(r, 16) for r in requests) + 2
        exact = mrc.pool_replay(requests, 16, big, **kw)
        assert mrc.stack_curve(requests, 16, 2048, **kw).unbounded_hit_tokens == exact.hit_tokens > 0


def test_a_shorter_use_of_a_trace_block_leaves_its_tail_cached():
    lines = [
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}',
        '{"timestamp": 1, "input_length": 100, "output_length": 1, "hash_ids": [1]}',
        '{"timestamp": 2, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}',
    ]
    requests = blocktrace.parse_lines(lines, "gen", 16).requests
    for size in (80, 2000):  # the pool holds the first request's 64 blocks, or everything
        curve = mrc.stack_curve(requests, 16, size, sizes=[size])
        assert curve.per_request_hits == mrc.pool_replay(requests, 16, size).per_request_hits
        assert curve.per_request_hits == [0, 6 * 16, 63 * 16]  # block 6..31 of hash 1 are still cached
