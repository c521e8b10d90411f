"""The reorder's worth per layout (derive/layouts.py): the walk in order and the branch points, by hand.
Against real outcomes: tests/analyzer/test_layout_estimates.py (the seed's real vLLM run, a chat log) and
tests/integration/test_real_vllm_reorder.py (real vLLM 0.32, both layouts run)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_exporter.derive.layouts import AnchorOrder


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
    remembering, plain = AnchorOrder(bound, remember_from=2), AnchorOrder(bound, remembered=0)
    for prints in events:
        read, read_plain = remembering.read(prints), plain.read(prints)
        for first in range(len(prints)):
            assert remembering.reached(read, first) == plain.reached(read_plain, first)
        remembering.learn(read)
        plain.learn(read_plain)
        assert (remembering.new, remembering.old) == (plain.new, plain.old)
