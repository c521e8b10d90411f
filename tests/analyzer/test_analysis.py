"""The analyzer on the real seed trace and on synthetic traces built to show one cause each."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from kvcache_exporter.analyzer import analysis, trace
from kvcache_exporter.analyzer.replay import replay
from kvcache_exporter.simulator import tokenizer


def requests_of(lines: list[dict]) -> list[trace.TraceRequest]:
    return [trace.parse_trace_line(line, n) for n, line in enumerate(lines)]


@pytest.fixture(scope="module")
def raw_report(seed_lines):
    return analysis.analyze(requests_of(seed_lines[:160]), block_size=32, num_gpu_blocks=96)


@pytest.fixture(scope="module")
def normalized_report(seed_lines):
    return analysis.analyze(requests_of(seed_lines[160:]), block_size=32, num_gpu_blocks=96)


def test_raw_phase_is_dynamic_prefix_at_the_front(raw_report, seed_lines):
    assert [line["phase"] for line in seed_lines[:160]] == ["raw"] * 160
    assert raw_report.observed.hit_ratio < 0.01
    # The replay matches what vLLM reported per request in this phase (0 cached tokens each).
    real = sum(line["usage"]["prompt_tokens_details"]["cached_tokens"] for line in seed_lines[:160])
    assert raw_report.observed.hit_tokens == real == 0
    assert raw_report.diagnoses[0].kind == "dynamic_prefix"
    assert raw_report.structure.first_block_unique_share == 1.0
    # The header: label 7 (shared by all) at token 0, then user id / timestamp / order no. of
    # header_len tokens; the fixed 200-token system block follows.
    header_lens = [line["header_len"] for line in seed_lines[:160]]
    field = raw_report.structure.dynamic_field
    assert field is not None
    assert field.start == 1
    assert field.end == max(header_lens) - 1
    assert field.median_len == statistics.median(header_lens)
    assert 200 <= field.template_tokens < 210
    assert field.requests == 160
    # Moving it last recovers what the normalized phase measured on real vLLM (0.8545).
    assert raw_report.dynamic_moved_last.hit_ratio > 0.8
    assert "capacity" not in [d.kind for d in raw_report.diagnoses]


def test_normalized_phase_hits_and_has_no_dynamic_prefix(normalized_report, seed_lines):
    real_hits = sum(line["usage"]["prompt_tokens_details"]["cached_tokens"] for line in seed_lines[160:])
    real_ratio = real_hits / sum(line["usage"]["prompt_tokens"] for line in seed_lines[160:])
    assert normalized_report.observed.hit_ratio > 0.8
    assert abs(normalized_report.observed.hit_ratio - real_ratio) < 0.02
    kinds = [d.kind for d in normalized_report.diagnoses]
    assert "dynamic_prefix" not in kinds and "capacity" not in kinds
    assert normalized_report.structure.dynamic_field is None
    assert normalized_report.structure.first_block_unique_share < 0.05
    top = normalized_report.structure.shared_prefixes[0]
    assert (top.tokens, top.requests) == (200, 160)  # the system block, shared by every request


def test_tiny_cache_is_diagnosed_as_capacity(seed_lines):
    report = analysis.analyze(requests_of(seed_lines[160:]), block_size=32, num_gpu_blocks=10)
    top = report.diagnoses[0]
    assert top.kind == "capacity"
    assert top.gain == pytest.approx(report.unbounded.hit_ratio - report.observed.hit_ratio)
    assert top.gain > 0.05
    assert 10 < report.capacity_blocks_needed <= 96
    check = replay(requests_of(seed_lines[160:]), 32, report.capacity_blocks_needed)
    assert check.hit_ratio >= report.unbounded.hit_ratio - 0.01


def chat_trace(sessions: int, turns: int, seed: int = 7) -> list[trace.TraceRequest]:
    """Multi-turn sessions interleaved turn by turn: each prompt extends the session's previous one."""
    rng = random.Random(seed)
    system = [rng.randint(5, 500) for _ in range(64)]
    history = {s: list(system) for s in range(sessions)}
    out = []
    for _ in range(turns):
        for s in range(sessions):
            history[s] += [rng.randint(5, 500) for _ in range(48)]
            out.append(trace.TraceRequest(list(history[s]), 8, f"user-{s}", index=len(out)))
            history[s] += [rng.randint(5, 500) for _ in range(8)]  # the answer goes into the next turn
    return out


def test_round_robin_over_replicas_is_diagnosed_as_affinity_loss():
    chats = chat_trace(sessions=13, turns=6)
    report = analysis.analyze(chats, block_size=16, num_gpu_blocks=4096, replicas=4, routing="round-robin")
    assert report.diagnoses[0].kind == "affinity"
    assert report.one_replica.hit_ratio - report.unbounded.hit_ratio > 0.3
    assert report.session_routing.hit_ratio > report.unbounded.hit_ratio + 0.3
    # Routing by session keeps each conversation on one replica: no affinity loss left.
    by_session = analysis.analyze(chats, block_size=16, num_gpu_blocks=4096, replicas=4, routing="session")
    assert "affinity" not in [d.kind for d in by_session.diagnoses]
    assert by_session.observed.hit_ratio == pytest.approx(report.one_replica.hit_ratio, abs=0.02)


def test_text_prompts_use_the_simulator_tokenizer():
    rng = random.Random(3)
    static = " ".join(f"rule{n} says be polite and precise ." for n in range(40))
    lines = [
        {
            "prompt": f"user {rng.randint(1, 10**9)} time {rng.randint(1, 10**9)} "
            f"order {rng.randint(1, 10**6)} " + static
        }
        for _ in range(40)
    ]
    requests = [trace.parse_trace_line(line, n) for n, line in enumerate(lines)]
    assert requests[0].prompt_token_ids == tokenizer.encode(lines[0]["prompt"])
    report = analysis.analyze(requests, block_size=16, num_gpu_blocks=1024)
    assert report.diagnoses[0].kind == "dynamic_prefix"
    assert report.structure.dynamic_field.start == 1  # "user" is the same word everywhere
    assert report.structure.dynamic_field.end == 5  # id, "time", id, "order", id


def test_unrelated_prompts_share_nothing():
    rng = random.Random(5)
    requests = [trace.TraceRequest([rng.randint(5, 500) for _ in range(200)], 4, index=i) for i in range(50)]
    report = analysis.analyze(requests, block_size=16, num_gpu_blocks=1024)
    assert [d.kind for d in report.diagnoses] == ["nothing_shared"]
    assert report.structure.dynamic_field is None


def test_concurrent_replays_against_the_sequential_seed(seed_lines):
    from kvcache_exporter.analyzer.replay import concurrent_replay

    requests = requests_of(seed_lines)
    sequential = replay(requests, 32, 96)
    one_client = concurrent_replay(requests, 32, 96, concurrency=1)
    assert one_client.per_request_hits == sequential.per_request_hits  # the seed was sent one at a time
    real = sum(line["usage"]["prompt_tokens_details"]["cached_tokens"] for line in seed_lines)
    assert sequential.hit_tokens == real
    crowded = concurrent_replay(requests, 32, 96, concurrency=64)
    assert crowded.preemptions > 0 and crowded.hit_ratio < sequential.hit_ratio
    assert crowded.rejected == 0 and crowded.prompt_tokens == sequential.prompt_tokens
    slow = concurrent_replay(requests, 32, 96, speed=0.01)  # gaps 100x longer: nothing overlaps
    assert slow.per_request_hits == sequential.per_request_hits and slow.preemptions == 0
    burst = concurrent_replay(requests, 32, 96, speed=1e6)
    assert burst.preemptions > 0
    with pytest.raises(ValueError):
        concurrent_replay(requests, 32, 96, concurrency=0)


def test_a_restart_in_a_closed_loop_replay_is_the_sequential_restart(seed_lines):
    from kvcache_exporter.analyzer.replay import concurrent_replay

    requests = requests_of(seed_lines)
    restarted = replay(requests, 32, 96, restarts=frozenset({200}))
    assert restarted.per_request_hits != replay(requests, 32, 96).per_request_hits
    one_client = concurrent_replay(requests, 32, 96, concurrency=1, restarts=frozenset({200}))
    assert one_client.per_request_hits == restarted.per_request_hits


def test_a_reorder_below_the_observed_ratio_is_explained_not_offered(normalized_report):
    """A template-first log whose 'per-request part' replays below what the cache already hits: the line
    says there is no gain and why, never a bare lower figure beside the observed one."""
    observed = normalized_report.observed
    lower = replace(observed, hit_ratio=observed.hit_ratio - 0.03)
    text = analysis.render_text(replace(normalized_report, dynamic_moved_last=lower))
    line = next(line for line in text.splitlines() if "moved to end" in line)
    said = f"no gain: its replay reads {lower.hit_ratio:.3f}, below this cache's {observed.hit_ratio:.3f}"
    assert said in line
    higher = replace(observed, hit_ratio=min(observed.hit_ratio + 0.03, 1.0))
    text = analysis.render_text(replace(normalized_report, dynamic_moved_last=higher))
    assert f"moved to end   {higher.hit_ratio:6.3f}  (exact replay)" in text
