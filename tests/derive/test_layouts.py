"""The reorder's worth per layout (derive/layouts.py): the walk in order and the branch points, by hand.
Against real outcomes: tests/analyzer/test_layout_estimates.py (the seed's real vLLM run, a chat log) and
tests/integration/test_real_vllm_reorder.py (real vLLM 0.32, both layouts run)."""

from __future__ import annotations

from kvcache_exporter.derive.layouts import AnchorOrder, pair_keys


def test_the_walk_stops_at_a_pair_never_seen_and_names_the_first_branch():
    order = AnchorOrder(1000)
    order.learn(pair_keys([1, 2, 3, 4]), [1, 2, 3, 4])
    assert order.reached(pair_keys([1, 2, 3, 9]), 0) == (2, 2)  # (3, 9) never followed each other
    assert order.reached(pair_keys([7, 2, 3, 4]), 0) == (0, 0)
    order.learn(
        pair_keys([1, 2, 3, 5]), [1, 2, 3, 5]
    )  # after (2, 3): 4 once, 5 now: requests go their own ways there
    assert order.reached(pair_keys([1, 2, 3, 5]), 0) == (3, 2)
    assert order.reached(pair_keys([2, 3, 4]), 0) == (2, 1)  # from any anchor on


def test_a_repeated_phrase_is_no_branch_in_its_context():
    order = AnchorOrder(1000)
    order.learn(
        pair_keys([1, 8, 2, 8, 3]), [1, 8, 2, 8, 3]
    )  # anchor 8 followed by 2, then by 3: in the contexts (1, 8) and (2, 8)
    assert order.reached(pair_keys([1, 8, 2, 8, 3]), 0) == (4, 4)
