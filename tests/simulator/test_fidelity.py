"""Replaying the real vLLM 0.32 seed trace through the engine model reproduces vLLM's prefix-cache numbers."""

from kvcache_exporter.simulator.blocks import BlockRemoved, BlockStored
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request


def replay(trace, run):
    engine = Engine(
        EngineConfig(block_size=run["block_size"], num_gpu_blocks=run["num_gpu_blocks"], max_model_len=2048)
    )
    now, results, batches = 0.0, [], []
    for line in trace:
        request = Request(
            str(line["i"]),
            line["prompt_token_ids"],
            line["max_tokens"],
            now,
            forced_output=line.get("completion_token_ids"),
        )
        engine.add_request(request)
        while engine.has_work:
            step = engine.step(now)
            now += step.duration
            if step.events:
                batches.append(step.events)
        results.append((line, request))
    return engine, results, batches


def snapshot_counter(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in snapshot")


def test_per_phase_hits_within_two_percent_of_real_vllm(seed_trace, seed_run, seed_snapshots):
    snapshots = seed_snapshots
    _, results, _ = replay(seed_trace, seed_run)
    for phase, (first, last) in seed_run["workload"]["phases"].items():
        real_queries = snapshot_counter(
            snapshots[last + 1], "vllm:prefix_cache_queries_total"
        ) - snapshot_counter(snapshots[first], "vllm:prefix_cache_queries_total")
        real_hits = snapshot_counter(snapshots[last + 1], "vllm:prefix_cache_hits_total") - snapshot_counter(
            snapshots[first], "vllm:prefix_cache_hits_total"
        )
        ours = [r for line, r in results if first <= line["i"] <= last]
        assert sum(len(r.prompt_token_ids) for r in ours) == real_queries
        our_hits = sum(r.num_cached_tokens for r in ours)
        assert abs(our_hits - real_hits) <= 0.02 * real_queries, (phase, our_hits, real_hits)


def test_per_request_cached_tokens_match_the_trace(seed_trace, seed_run):
    _, results, _ = replay(seed_trace, seed_run)
    exact = sum(
        line["usage"]["prompt_tokens_details"]["cached_tokens"] == r.num_cached_tokens for line, r in results
    )
    print(f"per-request cached_tokens: {exact}/{len(results)} exact")
    assert exact >= 0.95 * len(results)


def test_event_totals_match_the_real_stream(seed_trace, seed_run):
    _, _, batches = replay(seed_trace, seed_run)
    events = [e for batch in batches for e in batch]
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    # Real run (seed-scenario README): 351 batches, 300 BlockStored with 1375 hashes, 1281 BlockRemoved.
    assert (len(batches), len(stored), sum(len(e.block_hashes) for e in stored), len(removed)) == (
        351,
        300,
        1375,
        1281,
    )
