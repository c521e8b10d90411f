"""The injected-cause generator: seeded, and every case carries the change its kind says, nothing else."""

import itertools
from collections import Counter
from dataclasses import replace
from functools import cache

import pytest

from kvcache_exporter.accuracy.workload import KINDS, VERBATIM, Generator, Rerender, Shape

SHAPE = Shape("test", 32, 64 * 32, 1023, tuple(KINDS))


@cache
def cases(seed: int = 1, count: int = 6):
    return {
        kind: [case for case in Generator(SHAPE, seed).cases(count * len(KINDS)) if case[0].kind == kind]
        for kind in KINDS
    }


def answered(case):
    """The case as sent, each answer `answer` fresh tokens (one when none is asked), made up here."""
    out, prompt, answer = [], (), ()
    for i, request in enumerate(case):
        request = request.sent(prompt, answer)
        out.append(request)
        prompt, answer = request.prompt, tuple(600 + 1000 * i + j for j in range(max(request.answer, 1)))
    return out


def scored(case):
    return [r for r in case if r.expected is not None and r.kind == case[0].kind]


def setup(case):
    return [r for r in case if r.expected is None]


def test_the_same_seed_gives_the_same_workload_and_another_seed_another():
    first = list(Generator(SHAPE, 5).cases(40))
    assert first == list(Generator(SHAPE, 5).cases(40))
    assert first != list(Generator(SHAPE, 6).cases(40))


def test_every_case_scores_its_kind_with_its_truth_and_only_append_turns_beside_it():
    for kind, found in cases().items():
        assert found, kind
        for case in found:
            assert {r.kind for r in case} <= {kind, "append_turn"}
            assert scored(case) and all(r.expected == KINDS[kind][0] for r in scored(case))
            assert all(r.expected == "cold" for r in case if r.kind == "append_turn" and r.expected)
            assert setup(case) and case.index(setup(case)[-1]) < case.index(scored(case)[0])


def test_prompts_fit_the_model_and_a_case_a_third_of_the_cache():
    for kind, found in cases().items():
        for case in found:
            for request in answered(case):
                assert 0 < len(request.prompt) <= SHAPE.max_prompt
                if kind not in ("capacity_overflow", "host_tier_load", "window_dropped"):
                    assert len(request.prompt) <= SHAPE.capacity_tokens // 3, kind


def common_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def common_suffix(a, b) -> int:
    return common_prefix(a[::-1], b[::-1])


@pytest.mark.parametrize(
    ("kind", "longest"), [("timestamp_first", 10), ("request_id_first", 14), ("uuid_first", 36)]
)
def test_a_front_field_is_the_only_difference(kind, longest):
    for case in cases()[kind]:
        before, after = setup(case)[-1].prompt, scored(case)[0].prompt
        assert common_prefix(before, after) < longest
        assert len(after) - common_suffix(before, after) <= longest


def test_a_field_after_the_system_prompt_changes_the_middle_only():
    for case in cases()["field_after_system"]:
        before, after = setup(case)[-1].prompt, scored(case)[0].prompt
        head, tail = common_prefix(before, after), common_suffix(before, after)
        assert head > 5 and tail > 5 and len(after) - head - tail <= 16


@pytest.mark.parametrize("kind", ["documents_reranked", "tools_reordered"])
def test_moved_content_is_the_same_tokens_in_another_order(kind):
    for case in cases()[kind]:
        before, after = setup(case)[-1].prompt, scored(case)[0].prompt
        assert before != after and Counter(before) == Counter(after)


def test_a_rerender_drops_the_reasoning_or_reorders_the_arguments_or_keeps_the_answer():
    answer = tuple(range(100, 120))
    assert VERBATIM(answer) == answer
    assert Rerender(drop=5)(answer) == answer[5:]
    assert Rerender(cuts=(3, 10))(answer) == (*answer[10:], *answer[3:10], *answer[:3])


@pytest.mark.parametrize("kind", ["assistant_truncated", "tool_args_reserialized"])
def test_history_kinds_rerender_a_generated_answer_and_append_turns_carry_theirs_verbatim(kind):
    for case in cases()[kind]:
        first, then, *appended = case
        assert first.expected is None and first.follows is None
        assert min(6 * SHAPE.unit, SHAPE.capacity_tokens // 3 // 4) <= first.answer <= 10 * SHAPE.unit
        assert then.expected == "history_rewritten" and then.follows not in (None, VERBATIM)
        assert all(r.follows == VERBATIM and r.expected == "cold" for r in appended)
        assert all(r.answer for r in case[:-1]) and case[-1].answer == 0  # the last answer is not used
        sent = answered(case)
        generated, start = tuple(range(600, 600 + first.answer)), len(sent[0].prompt)  # answered()'s
        rerendered = sent[1].prompt[start : len(sent[1].prompt) - len(then.prompt)]
        assert rerendered == then.follows(generated) and rerendered != generated
        if kind == "assistant_truncated":  # the answer's first eighth to third left out
            assert first.answer // 8 <= first.answer - len(rerendered) <= first.answer // 3
            assert rerendered == generated[then.follows.drop :]
        else:  # the same tokens, another order, after the template's call opener
            assert sent[0].prompt[-2:] == (4, 15) and 3 <= len(then.follows.cuts) + 1 <= 5
            assert Counter(rerendered) == Counter(generated)


def test_append_turns_extend_the_previous_prompt_by_at_least_a_unit():
    turns = 0
    for found in cases().values():
        for case in found:
            for previous, request in itertools.pairwise(answered(case)):
                if request.kind == "append_turn" and request.expected:
                    turns += 1
                    assert request.prompt[: len(previous.prompt)] == previous.prompt
                    assert len(request.prompt) - len(previous.prompt) > SHAPE.unit
    assert turns > 20


def test_no_change_kinds_resend_the_prompt():
    for kind, before in [("exact_repeat", None), ("cache_reset", "reset"), ("engine_restart", "restart")]:
        for case in cases()[kind]:
            assert setup(case)[-1].prompt == scored(case)[0].prompt and scored(case)[0].before == before
            assert len(scored(case)[0].prompt) % SHAPE.unit  # a whole-unit prompt recomputes its last unit
    for case in cases()["other_identity"]:
        assert setup(case)[-1].prompt == scored(case)[0].prompt and scored(case)[0].identity


def test_overflow_sends_more_than_the_cache_then_each_prompt_again():
    for case in cases()["capacity_overflow"]:
        first = [r.prompt for r in setup(case)]
        assert sum(map(len, first)) >= 1.5 * SHAPE.capacity_tokens
        assert [r.prompt for r in scored(case)] == first


def test_a_short_shared_prefix_is_under_a_unit_and_both_prompts_over_one():
    for case in cases()["short_shared_prefix"]:
        before, after = setup(case)[-1].prompt, scored(case)[0].prompt
        assert SHAPE.unit // 2 <= common_prefix(before, after) < SHAPE.unit < min(len(before), len(after))


def test_a_host_tier_case_turns_the_gpu_cache_over_before_the_prompt_comes_back():
    for case in cases()["host_tier_load"]:
        assert case[0].prompt == case[-1].prompt
        assert sum(len(r.prompt) for r in case[1:-1]) >= 1.2 * SHAPE.capacity_tokens


def test_a_shape_gets_only_its_kinds():
    shape = Shape("small", 16, 4096, 2047, ("exact_repeat", "uuid_first"))
    assert {case[0].kind for case in Generator(shape, 1).cases(10)} == {"exact_repeat", "uuid_first"}


def test_a_window_fill_measured_on_the_server_is_one_action_and_the_old_fill_stays():
    """With `fill_by_events` the fill is the backend's "drop_window" action (no prompt of its own: the
    scored prompt still differs from the last one sent); without it, half a cache of prompts as the
    recordings were made (their cases must not move)."""
    measured = replace(SHAPE, fill_by_events=True)
    for case in Generator(measured, 1).cases(4 * len(KINDS)):
        if case[0].kind == "window_dropped":
            assert [(r.prompt, r.before) for r in case[1:]] == [((), "drop_window"), (case[0].prompt, None)]
    for case in cases()["window_dropped"]:
        assert {r.before for r in case} == {None}
        assert sum(len(r.prompt) for r in case[1:-1]) >= 0.5 * SHAPE.capacity_tokens
