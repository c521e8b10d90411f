"""The layout finder and the reorder's worth: chat traces with the per-request fields first in the system
message (the chat template's role header in front of them), with the simulator's tokenizer and a real
one, and the seed's raw phase against what real vLLM measured once the header was moved."""

from __future__ import annotations

import pytest

from kvcache_exporter.analyzer import analysis, reorder, trace
from kvcache_exporter.analyzer.replay import replay
from kvcache_exporter.analyzer.tokenize import ModelTokenizer

from .test_tokenize import TINY_LLAMA
from .traces import chat_lines


def test_the_role_header_is_the_head_not_the_template():
    header, template = [1, 2, 3], list(range(100, 140))
    prompts = [[*header, 50 + n, 60 + n, *template, 7, 8] for n in range(10)]
    found = reorder.layouts(prompts, 16)
    assert found == [reorder.Layout(3, 5, 47)] * 10  # the shared 7, 8 belong to it
    assert reorder.reorder(prompts[0], found[0]) == [*header, *template, 7, 8, 50, 60]
    field = reorder.dynamic_field(found)
    shape = (field.start, field.end, field.median_len, field.template_tokens, field.requests)
    assert shape == (3, 4, 5, 42, 10)


def test_a_layout_already_fixed_is_left_alone():
    template = list(range(100, 140))
    prompts = [[1, 2, *template, 50 + n, 60 + n] for n in range(10)]
    assert reorder.layouts(prompts, 16) == [None] * 10
    assert reorder.reordered_prompts(prompts, 16) == prompts


def test_shared_content_shorter_than_a_hit_unit_is_not_a_template():
    prompts = [[1, 50 + n, *range(100, 112), 70 + n] for n in range(10)]  # 12 shared tokens
    assert reorder.layouts(prompts, 16) == [None] * 10
    assert reorder.layouts(prompts, 8) != [None] * 10


def test_heads_are_what_half_the_requests_share():
    prompts = [[1, 2, 3, n] for n in range(6)] + [[1, 9, n] for n in range(4)]
    assert reorder.shared_heads(prompts) == [3] * 6 + [1] * 4


def chat_requests(fields: str, encoder=None) -> list[trace.TraceRequest]:
    lines = chat_lines(200, fields)
    return [trace.parse_trace_line(line, n, encoder=encoder) for n, line in enumerate(lines)]


@pytest.mark.parametrize("tokenizer", [None, TINY_LLAMA], ids=["simulator-tokenizer", "tiny-llama"])
@pytest.mark.parametrize("fields", ["timestamp", "customer"])
@pytest.mark.parametrize("blocks", [2048, 300])
def test_fields_first_in_the_system_message_are_the_top_diagnosis(tokenizer, fields, blocks):
    encoder = ModelTokenizer(tokenizer) if tokenizer else None
    report = analysis.analyze(chat_requests(fields, encoder), 16, blocks)
    top = report.diagnoses[0]
    assert top.kind == "dynamic_prefix", report.diagnoses
    assert report.observed.hit_ratio < 0.2 and top.gain > 0.7
    assert top.after == report.dynamic_moved_last.hit_ratio
    field = report.structure.dynamic_field
    assert field.requests == 200 and field.start > 0  # the role header stays in front
    assert field.template_tokens >= 100
    # What the fix gives: the same requests written with the fields after the shared part (at the end of
    # the user message), replayed. The reorder moves them to the very end (after the assistant cue too),
    # so the question's last block can hit as well: within 0.08 of the rewritten trace.
    fixed = replay(chat_requests("last", encoder), 16, blocks).hit_ratio
    if fields == "timestamp":
        assert abs(top.after - fixed) < 0.08
    assert all(d.gain <= top.gain for d in report.diagnoses)


def test_the_fixed_layout_has_nothing_to_reorder():
    report = analysis.analyze(chat_requests("last"), 16, 2048)
    assert "dynamic_prefix" not in [d.kind for d in report.diagnoses]
    assert report.observed.hit_ratio > 0.8


def test_seed_raw_phase_predicts_the_real_normalized_phase(seed_lines):
    raw = [trace.parse_trace_line(line, n) for n, line in enumerate(seed_lines[:160])]
    report = analysis.analyze(raw, 32, 96)
    normalized = seed_lines[160:]
    real = sum(line["usage"]["prompt_tokens_details"]["cached_tokens"] for line in normalized) / sum(
        line["usage"]["prompt_tokens"] for line in normalized
    )
    assert report.diagnoses[0].kind == "dynamic_prefix"
    assert abs(report.diagnoses[0].after - real) < 0.05
