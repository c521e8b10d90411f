"""tools/soak_fleet.py's reading of a run: RSS is judged only once the bounded attribution tables
have each been full, and its slope is a fitted line, not two end points a sawtooth can tilt."""

from __future__ import annotations

from kvcache_exporter.tools.soak_fleet import MAX_FINGERPRINTS, MAX_TRACKED_BLOCKS, Point, _slope, filled_at


def point(minute: float, blocks: float, fingerprints: float, rss: float = 50.0) -> Point:
    tracked = {"blocks": blocks, "fingerprints": fingerprints}
    return Point(minute * 60, {"vllm-0": rss}, {"vllm-0": 0.0}, 0, False, 0.0, 0.0, tracked)


def test_warm_once_each_table_has_been_at_its_bound_even_if_not_at_the_same_sample():
    half_b, half_f = MAX_TRACKED_BLOCKS / 2, MAX_FINGERPRINTS / 2
    points = [
        point(10, half_b, MAX_FINGERPRINTS),  # fingerprints full first, then halved
        point(20, MAX_TRACKED_BLOCKS - 100, half_f),  # blocks at 99.5 % of theirs
        point(30, half_b, half_f),
    ]
    assert filled_at(points) == 20 * 60
    assert filled_at(points[:1]) is None  # blocks never full: not warmed up


def test_the_slope_is_a_fitted_line_through_a_sawtooth():
    hours = [i / 10 for i in range(21)]
    flat_teeth = [50.0 + (0.4 if i and i % 5 == 0 else 0.0) for i in range(21)]  # ends on a tooth
    assert abs(_slope(hours, flat_teeth)) < 0.1
    assert (flat_teeth[-1] - flat_teeth[0]) / 2 > 0.1  # what the end points alone would say
    assert abs(_slope(hours, [50.0 + h for h in hours]) - 1.0) < 1e-9
    assert _slope([0.0], [50.0]) == 0.0
