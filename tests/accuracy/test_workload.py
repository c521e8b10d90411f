"""The injected-cause generator: seeded, and every case carries the change its kind says, nothing else."""

import itertools
from collections import Counter
from functools import cache

import pytest

from kvcache_exporter.accuracy.workload import KINDS, Generator, Shape

SHAPE = Shape("test", 32, 64 * 32, 1023, tuple(KINDS))


@cache
def cases(seed: int = 1, count: int = 6):
    return {
        kind: [case for case in Generator(SHAPE, seed).cases(count * len(KINDS)) if case[0].kind == kind]
        for kind in KINDS
    }


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
            for request in case:
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


@pytest.mark.parametrize("kind", ["documents_reranked", "tools_reordered", "tool_args_reserialized"])
def test_moved_or_reserialised_content_is_the_same_tokens_in_another_order(kind):
    for case in cases()[kind]:
        before, after = setup(case)[-1].prompt, scored(case)[0].prompt
        assert before != after and Counter(before) == Counter(after)


def test_a_truncated_assistant_turn_loses_its_first_tokens_only():
    for case in cases()["assistant_truncated"]:
        before, after = setup(case)[-1].prompt, scored(case)[0].prompt
        head = common_prefix(before, after)
        assert (
            1 <= len(before) - len(after) <= 8 and before[len(before) - len(after) + head :] == after[head:]
        )


def test_append_turns_extend_the_previous_prompt_by_at_least_a_unit():
    turns = 0
    for found in cases().values():
        for case in found:
            for previous, request in itertools.pairwise(case):
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
