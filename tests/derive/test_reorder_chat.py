"""The prefix_diverged rule on OpenAI chat traces whose system message starts with a timestamp and a
customer id: the chat template's role header first, then the per-request field, then the shared
system prompt. The live estimate (hits + prefix_diverged) beside the exact replay of the reorder."""

from __future__ import annotations

import json

import pytest

from kvcache_exporter.analyzer import analysis, trace
from kvcache_exporter.analyzer.cli import main
from kvcache_exporter.analyzer.tokenize import ModelTokenizer
from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.reorder import KnownRun, first_known_run, served_tokens, unit_shortfall_tokens
from tests.analyzer.test_tokenize import TINY_LLAMA
from tests.analyzer.traces import chat_lines
from tests.derive.test_attribution import BS, Stream

UNCAPPED = 100_000  # blocks: nothing is evicted, the estimate and the replay see the same cache


def test_a_short_known_head_at_the_divergence_point_is_skipped():
    """Known content at the divergence point short of a unit (the shared head's tail), unseen content,
    then known content: the run after the unseen content is the one a reorder serves, near the prompt's
    start only (behind a long shared part, recurring content after a unique middle stays cold)."""
    run = first_known_run([2, 8, 30, 50], [True, False, True, True], 96, root=False, unit=16, depth=16)
    assert run == KnownRun(start=26, end=96, fronted=True, head=12)
    deep = first_known_run([2, 8, 30, 50], [True, False, True, True], 96, root=False, unit=16, depth=320)
    assert deep.head == 0 and not deep.fronted
    assert served_tokens(run, 96, 16) == 64
    assert unit_shortfall_tokens(run, 16) == 12  # the head's tail still never hits
    assert served_tokens(run, 96, 16, continues=True) == unit_shortfall_tokens(run, 16, continues=True) == 0


def test_a_whole_unit_known_at_the_divergence_point_ends_the_search():
    """Content that recurs right at the divergence point for a whole unit or more is already first:
    what comes back after unique content behind it is not served."""
    run = first_known_run([2, 30, 50], [True, False, True], 96, root=False, unit=16)
    assert run == KnownRun(start=0, end=34, fronted=False)
    assert served_tokens(run, 96, 16) == 0


def test_a_front_without_anchors_counts_behind_a_cached_prefix_from_a_whole_unit_on():
    """Digits of small ids may hold no anchor: known content to the end of the new tokens whose first
    anchor lies a unit plus an anchor spacing past the divergence point has a per-request front, near
    the prompt's start only (behind a long shared part it is a unique middle, not a field order)."""
    assert first_known_run([40, 60], [True, True], 96, root=False, unit=16, depth=16).fronted
    assert not first_known_run([24, 60], [True, True], 96, root=False, unit=16, depth=16).fronted
    assert not first_known_run([40, 60, 80], [True, True, False], 96, root=False, unit=16, depth=16).fronted
    assert not first_known_run([40, 60], [True, True], 96, root=False, unit=16, depth=320).fronted
    assert not first_known_run([40, 60], [True, True], 96, root=False, unit=16).fronted  # depth unknown


def chat_requests(encoder) -> list[trace.TraceRequest]:
    return [
        trace.parse_trace_line(line, n, encoder=encoder)
        for n, line in enumerate(chat_lines(200, "timestamp"))
    ]


def live_estimate(prompts: list[list[int]]) -> float:
    """The sidecar's estimate, each prompt's computed full blocks sent as vLLM sends them: hits are the
    longest stored chain prefix (never the whole prompt: vLLM recomputes its last token)."""
    stream, stored, hits, queries = Stream(Attribution(hit_unit=BS)), set(), 0, 0
    for tokens in prompts:
        parent, chain = None, []
        for i in range(len(tokens) // BS):
            parent = hash((parent, tuple(tokens[i * BS : (i + 1) * BS])))
            chain.append(parent)
        cached = 0
        while cached < min(len(chain), (len(tokens) - 1) // BS) and chain[cached] in stored:
            cached += 1
        hashes = stream.prompt(tokens, cached)
        stored.update(hashes)
        hits, queries = hits + cached * BS, queries + len(tokens)
    return (hits + stream.attribution.totals.tokens["prefix_diverged"]) / queries


def test_the_live_estimate_is_the_exact_reorder_on_a_chat_trace():
    """tiny-llama's tokens: the field's digits hold no anchor and the role header plus `Time: 2026-...`
    fills the first block, so the divergence point sits behind a cached prefix with no unseen anchor
    before the shared system prompt. The estimate falls short of the replay by the shared head's
    tail, which the reorder joins to the system prompt's first unit (under 0.05)."""
    encoder = ModelTokenizer(TINY_LLAMA)
    requests = chat_requests(encoder)
    exact = analysis.analyze(requests, BS, UNCAPPED).dynamic_moved_last.hit_ratio
    estimate = live_estimate([r.prompt_token_ids for r in requests])
    assert exact > 0.9
    assert exact - 0.05 < estimate <= exact, (estimate, exact)


@pytest.mark.parametrize("tokenizer", [TINY_LLAMA, None], ids=["tiny-llama", "simulator-tokenizer"])
def test_the_analyzer_prints_the_live_rule_beside_the_exact_replay(tmp_path, capsys, tokenizer):
    """The analyzer's live-rule estimate (its curve's prefix_diverged tokens) beside its exact replay.
    With the simulator's tokenizer anchors are rare (small ids: one token in 61 of this system
    prompt), so the known run is estimated to start up to an anchor gap after the shared content
    does: the estimate stays below the replay there, never above it."""
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in chat_lines(200, "timestamp")))
    assert main([str(path), "--format", "json", *(["--tokenizer", str(tokenizer)] if tokenizer else [])]) == 0
    report = json.loads(capsys.readouterr().out)
    exact, estimate = report["dynamic_moved_last"]["hit_ratio"], report["reordered_estimate"]
    if tokenizer:
        assert exact - 0.05 < estimate <= exact, (estimate, exact)
    else:
        assert report["observed"]["hit_ratio"] < estimate <= exact, (estimate, exact)
