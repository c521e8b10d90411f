"""The content causes' spans (derive/content_causes.py) on hand-made anchor lists."""

from kvcache_exporter.derive.content_causes import (
    foreign_span,
    known_runs,
    moved_span,
    rewritten_span,
    whole_units,
)


def test_whole_units_cut_a_span_or_none():
    assert whole_units(10, 60, 16) == (10, 58)
    assert whole_units(10, 20, 16) is None
    assert whole_units(0, 64, 0) is None


def test_rewritten_history_runs_from_the_divergence_point_to_the_last_generated_content():
    positions = [5, 30, 70, 120, 150]
    # the last generated anchor at 120, the next (not generated) at 150: its content ends at 150 + 4
    assert rewritten_span(positions, [False, True, False, True, False], 200, 16) == (0, 144)
    assert rewritten_span([5, 30, 70, 120, 125], [False, True, False, True, False], 200, 16) == (0, 128)
    assert rewritten_span(positions, [False, False, False, False, True], 200, 16) == (0, 192)  # to the end
    assert rewritten_span(positions, [False] * 5, 200, 16) is None
    assert rewritten_span([3], [True], 12, 16) is None  # less than a unit


def test_known_runs_cover_their_anchors_windows():
    assert known_runs([0, 20, 40, 60], [True, True, False, True], 64) == [(0, 1, 0, 28), (3, 3, 60, 64)]


def test_runs_joined_by_a_seam_are_moved_and_a_gap_of_new_content_is_not():
    positions = [2, 30, 60, 93, 110, 140, 190]
    seen = [True, True, True, False, True, True, True]  # one unseen anchor: a seam
    assert moved_span(positions, seen, 200, 16, 0, 0) == (0, 192)
    gap = [2, 30, 60, 80, 95, 140, 190]
    seen = [True, True, True, False, False, True, True]  # 15 tokens of unseen anchors: new content
    assert moved_span(gap, seen, 200, 16, 0, 0) is None
    assert (
        moved_span(positions, [True, True, True, False, True, False, False], 200, 16, 0, 0) is None
    )  # 8 < 16
    assert moved_span(positions, [True] * 7, 200, 16, 0, 0) is None  # one run: nothing moved


def test_content_known_only_under_another_identity_is_the_isolated_span():
    positions = [0, 40, 80, 120]
    assert foreign_span(positions, [True, True, True, True], 160, 32) == (0, 160)
    # the last foreign anchor at 80, the next at 120: its content ends at 124; 84 tokens from 40: two units
    assert foreign_span(positions, [False, True, True, False], 160, 32) == (40, 104)
    assert foreign_span([0, 40, 80, 90], [False, True, True, False], 160, 32) == (40, 72)  # ends at 94
    assert foreign_span(positions, [False] * 4, 160, 32) is None
