"""The deployment shapes of issue 20 on the REAL vLLM 0.32 CPU server, each started once per session:
DeepSeek-V4 (6 KV-cache groups, 256-token hit unit, through ../shared/tools/deepseek-v4-cpu), a
Gemma-3-pattern hybrid (6 groups), and data parallel 2 with two LoRA adapters, session ids and
kv_cache_report_mode=full on one server.

Prompts are token ids whose length is a whole number of hit units plus 3: vLLM computes those 3
tokens and stores them nowhere (no event can show them), so coverage is checked at 5 %, never above.
Workloads: a per-request header before a shared template (prefix_diverged must dominate), then exact
repeats (no misses beyond the never-cacheable 3 tokens), then more distinct prompts than the cache
holds and the first of them again (evicted), then a prompt again after vLLM's /reset_prefix_cache
(AllBlocksCleared: restart), then the fix: the template first and the header after it (no
prefix_diverged).
"""

from __future__ import annotations

import random

import pytest

from tests.integration.miss_tokens import (
    computed,
    delta,
    reset_prefix_cache,
    scrape,
    send,
    serve_args,
    settle_engines,
    tokens,
    warm_up,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TAIL = 3
MAX_TURNOVER_PROMPTS = 248  # rounds of 8, 16, 32, 64, 128: a cache this size turns over sooner


def header_then_repeats(rng, unit: int, units: int) -> tuple[list, list]:
    """Six prompts: an 8-token header before a shared template; then one new prompt sent four times."""
    template = tokens(rng, units * unit - 8)
    diverged = [tokens(rng, 8) + template + tokens(rng, TAIL) for _ in range(6)]
    repeated = tokens(rng, units * unit + TAIL)
    return diverged, [repeated] * 4


def check_shape(exporter, server, unit: int, units: int, engine: str | None = None, headers=None) -> dict:
    rng = random.Random(20 + int(engine or 0))
    vllm_engine = engine or "0"
    start, start_computed = settle_engines(exporter, (engine,))[engine], computed(server, vllm_engine)
    diverged, repeats = header_then_repeats(rng, unit, units)
    for prompt in diverged:
        send(server, prompt, headers=headers)
    after_header = settle_engines(exporter, (engine,))[engine]
    got = delta(after_header, start)
    assert got["prefix_diverged"] > 0.6 * sum(got.values()), got
    assert sum(got.values()) == 6 * units * unit, got  # every unit once, whatever the groups

    for prompt in repeats:
        send(server, prompt, headers=headers)
    after_repeats = settle_engines(exporter, (engine,))[engine]
    got = delta(after_repeats, after_header)
    assert sum(got.values()) == units * unit and got["cold"] == units * unit, got  # the first send only

    # Turn the cache over: new prompts until vLLM itself recomputes one sent long before (each probe
    # another of the first batch, so no probe refreshes the next; rounds double). A hybrid cache keeps
    # more units than its page count suggests (out-of-window pages go first), so how many prompts it
    # takes is read from vLLM, not assumed.
    first = [tokens(rng, units * unit + TAIL) for _ in range(8)]
    for prompt in first:
        send(server, prompt, headers=headers)
    recomputed, batch, sent = 0.0, 8, 0
    for probe in first:
        for _ in range(batch):
            send(server, tokens(rng, units * unit + TAIL), headers=headers)
        sent, batch = sent + batch, 2 * batch
        before_probe, computed_before = (
            settle_engines(exporter, (engine,))[engine],
            computed(server, vllm_engine),
        )
        send(server, probe, headers=headers)
        after_evictions = settle_engines(exporter, (engine,))[engine]  # vLLM's counters have caught up too
        recomputed = computed(server, vllm_engine) - computed_before - TAIL
        if recomputed >= unit or sent >= MAX_TURNOVER_PROMPTS:
            break
    assert recomputed >= unit, "vLLM never recomputed a prompt sent long before: no eviction happened"
    got = delta(after_evictions, before_probe)
    # cache pressure: evicted, or on a hybrid model window_expired where a unit's sliding-window part
    # went first while its full-attention part was still held (docs/kv-events.md, window_expired)
    pressure = got["evicted"] + got.get("window_expired", 0.0)
    assert pressure == recomputed and sum(got.values()) == recomputed, (got, recomputed)
    distinct = [probe]

    reset_prefix_cache(server)
    send(server, distinct[-1], headers=headers)  # held until the reset: lost with the cache, not evicted
    after_reset = settle_engines(exporter, (engine,))[engine]
    got = delta(after_reset, after_evictions)
    assert got["restart"] == units * unit and sum(got.values()) == units * unit, got

    fixed = tokens(rng, units * unit)
    for _ in range(6):  # the fix: the shared part first, the per-request header after it
        send(server, fixed + tokens(rng, 8 + TAIL), headers=headers)
    after_fix = settle_engines(exporter, (engine,))[engine]
    got = delta(after_fix, after_reset)
    assert got["prefix_diverged"] == 0 and got["cold"] == units * unit, got  # the template once, then hits
    after_repeats = after_fix

    attributed = sum(after_repeats.values()) - sum(start.values())
    vllm_computed = computed(server, vllm_engine) - start_computed
    print(f"\nengine {vllm_engine}: attributed {attributed:.0f} of {vllm_computed:.0f}: {after_repeats}")
    assert 0.95 * vllm_computed <= attributed <= vllm_computed
    return after_repeats


def test_deepseek_v4_hit_units(vllm_dsv4, start_exporter) -> None:
    with start_exporter(*serve_args(vllm_dsv4)) as exporter:
        warm_up(exporter, vllm_dsv4, random.Random(1), 256 + TAIL)
        check_shape(exporter, vllm_dsv4, 256, 3)
        samples = scrape(exporter)
        groups = [labels for name, labels, _ in samples if name == "kvcache_kv_events_group_info"]
        assert sorted(g["block_size"] for g in groups) == ["256", "4", "64", "64", "64", "8"], groups
        assert ("kvcache_kv_events_hit_unit_tokens", {}, 256.0) in samples


def test_gemma3_six_groups(vllm_gemma3, start_exporter) -> None:
    with start_exporter(*serve_args(vllm_gemma3)) as exporter:
        warm_up(exporter, vllm_gemma3, random.Random(2), 32 + TAIL)
        check_shape(exporter, vllm_gemma3, 32, 10)
        groups = [labels for name, labels, _ in scrape(exporter) if name == "kvcache_kv_events_group_info"]
        assert len(groups) == 6 and sum(g["kind"] == "sliding_window" for g in groups) == 5, groups


def test_data_parallel_lora_sessions_and_reuse_reports(vllm_dp_lora, start_exporter) -> None:
    server = vllm_dp_lora
    engines = ("0", "1")

    def route(engine):
        return {"X-data-parallel-rank": engine}

    with start_exporter(*serve_args(server, "--kv-events.data-parallel-size", "2")) as exporter:
        warm_up(exporter, server, random.Random(3), 32 + TAIL, engines, route)
        for engine in engines:  # each rank its own stream, its own /metrics engine
            check_shape(exporter, server, 32, 10, engine, route(engine))

        rng = random.Random(4)
        prompt = tokens(rng, 320 + TAIL)
        before = settle_engines(exporter, engines)
        for model in ("tiny", "tiny-lora-a", "tiny-lora-b"):  # one text, three identities
            send(server, prompt, model, route("0"), session_id=f"s-{model}")
        send(
            server,
            prompt,
            "tiny",
            route("0"),
            session_id="s-report",
            vllm_xargs={"kv_cache_report_mode": "full"},
        )
        after = settle_engines(exporter, engines)
        got = delta(after["0"], before["0"])
        # the text once cold, then under each adapter identity_isolated (by design), never "diverged"
        assert got["cold"] == 320 and got["identity_isolated"] == 2 * 320 and got["prefix_diverged"] == 0, got
        assert delta(after["1"], before["1"]) == dict.fromkeys(after["1"], 0.0)

        samples = scrape(exporter)
        stored = {
            labels["adapter"]: value
            for name, labels, value in samples
            if name == "kvcache_kv_events_stored_tokens_total" and labels["engine"] == "0"
        }
        assert stored["tiny-lora-a"] >= 320 and stored["tiny-lora-b"] >= 320, stored
        reused = {
            (labels["session"], labels["kind"]): value
            for name, labels, value in samples
            if name == "kvcache_kv_events_session_tokens_total" and labels["engine"] == "0"
        }
        assert reused[("s-report", "reused")] == 320, reused
        ratio = [
            v
            for n, labels, v in samples
            if n == "kvcache_kv_events_session_id_ratio" and labels["engine"] == "0"
        ]
        assert ratio and 0 < ratio[0] < 1
