"""The reorder's worth against the REAL vLLM 0.32 CPU server (the session's one start, conftest.py).

The seed scenario's two layouts, live: a per-request header (user id, timestamp, order number)
first, then the same requests with the shared template first and the header last. While only the
header-first phase has been seen, prefix_diverged dominates its misses and the reordered estimate
(hits + prefix_diverged) / queries predicts the fixed layout's real hit ratio; in the fixed phase
prefix_diverged is not dominant. Then the template first with the header between it and recurring
questions: the header still costs the questions behind it, a part of the misses is prefix_diverged.

Measured (2026-12-03): header first 0.000 hit ratio, reordered estimate 0.870, prefix_diverged 93 %;
template first 0.856 (estimate 0.856), prefix_diverged 0; template/header/question 0.743, 2 %.
Measured (2026-12-04, order-aware seams): template/header/question 0.743, prefix_diverged 29 %,
estimate at the end 0.797 (the header-last phase reached 0.856)."""

from __future__ import annotations

import random

import pytest

from kvcache_exporter.derive.reorder import reordered_hit_ratio
from tests.integration.miss_tokens import (
    causes,
    delta,
    prefix_counters,
    scrape,
    send,
    serve_args,
    settle,
    tokens,
    warm_up,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
N = 32  # requests per phase


def header(rng: random.Random) -> list[int]:
    """[7] user id [8] timestamp [9] order number: 12-20 tokens, random per request."""
    return [7, *tokens(rng, rng.randint(3, 5)), 8, *tokens(rng, rng.randint(4, 6)), 9, *tokens(rng, 4)]


def reorder_tokens(exporter) -> dict[str, float]:
    """kvcache_prefix_cache_reorder_hit_tokens_total by layout."""
    found = scrape(exporter)
    return {
        labels["layout"]: v for n, labels, v in found if n == "kvcache_prefix_cache_reorder_hit_tokens_total"
    }


def run_phase(exporter, server, prompts: list[list[int]]) -> tuple[dict[str, float], float, dict[str, float]]:
    """(miss tokens by cause, hit ratio, reordered estimates: all prefix_diverged, and per layout) over the
    phase, from both sides' counters."""
    before, (hits0, queries0), moved0 = causes(exporter), prefix_counters(server), reorder_tokens(exporter)
    for prompt in prompts:
        send(server, prompt)
    after = settle(exporter)
    hits, queries = prefix_counters(server)
    got, moved = delta(after, before), delta(reorder_tokens(exporter), moved0)
    hits, queries = hits - hits0, queries - queries0
    estimates = {layout: reordered_hit_ratio(hits, queries, n) for layout, n in moved.items()}
    estimates["known"] = reordered_hit_ratio(hits, queries, got.get("prefix_diverged", 0.0))
    return got, hits / queries, estimates


def test_the_reorder_is_predicted_live_and_the_cause_goes_away_after_it(vllm_server, start_exporter):
    rng = random.Random(21)
    template = tokens(rng, 200)
    questions = [tokens(rng, rng.randint(20, 60)) for _ in range(6)]
    asked = [rng.choice(questions) for _ in range(3 * N)]
    with start_exporter(*serve_args(vllm_server, "--collect.windows", "1h")) as exporter:
        warm_up(exporter, vllm_server, rng, 4 * 32)
        settle(exporter)

        raw = [header(rng) + template + q for q in asked[:N]]
        raw_causes, raw_ratio, raw_estimate = run_phase(exporter, vllm_server, raw)
        fixed = [template + q + header(rng) for q in asked[N : 2 * N]]
        fixed_causes, fixed_ratio, fixed_estimate = run_phase(exporter, vllm_server, fixed)
        between = [template + header(rng) + q for q in asked[2 * N :]]
        between_causes, between_ratio, between_estimate = run_phase(exporter, vllm_server, between)
        gauge = [
            v for n, _, v in scrape(exporter) if n == "kvcache_prefix_cache_hit_ratio_reordered_estimate"
        ]

    for name, got, ratio, estimate in (
        ("header first", raw_causes, raw_ratio, raw_estimate),
        ("template first, header last", fixed_causes, fixed_ratio, fixed_estimate),
        ("template, header, question", between_causes, between_ratio, between_estimate),
    ):
        shares = {c: round(n / sum(got.values()), 3) for c, n in got.items() if n}
        said = ", ".join(f"{k} {v:.3f}" for k, v in estimate.items())
        print(f"\n{name}: hit ratio {ratio:.3f}, reordered estimates {said}, misses {shares}")
    assert raw_causes["prefix_diverged"] > 0.7 * sum(raw_causes.values()), raw_causes
    # each layout's estimate made during the header-first phase is that layout's real outcome (item 5)
    assert raw_ratio < 0.05 and abs(raw_estimate["end"] - fixed_ratio) <= 0.03, (raw_estimate, fixed_ratio)
    assert abs(raw_estimate["after_template"] - between_ratio) <= 0.03, (raw_estimate, between_ratio)
    assert fixed_causes.get("prefix_diverged", 0) < 0.2 * sum(fixed_causes.values()), fixed_causes
    assert abs(fixed_estimate["end"] - fixed_ratio) < 0.05, (fixed_estimate, fixed_ratio)
    # the header after the template still costs the questions that recur behind it (the header-last
    # phase hit more): named prefix_diverged, the accuracy suite's field_after_system, and the
    # estimate made then says a gain no larger than what that layout really reached
    assert 0 < between_causes.get("prefix_diverged", 0) < 0.5 * sum(between_causes.values()), between_causes
    assert between_ratio < between_estimate["end"] <= fixed_ratio + 0.03, (between_estimate, fixed_ratio)
    assert gauge and 0 < max(gauge) <= 1  # the exporter's own gauge, over its 1h window
