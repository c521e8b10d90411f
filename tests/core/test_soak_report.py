"""tools/soak_fleet.py's reading of a run: RSS is judged only once the bounded attribution memory
has been full, and its slope is a fitted line, not two end points a sawtooth can tilt."""

from __future__ import annotations

from kvcache_exporter.tools.soak_fleet import MAX_FINGERPRINTS, MAX_TRACKED_BLOCKS, Point, _slope, filled_at


def point(minute: float, blocks: float, fingerprints: float, rss: float = 50.0) -> Point:
    tracked = {"blocks": blocks, "fingerprints": fingerprints}
    return Point(minute * 60, {"vllm-0": rss}, {"vllm-0": 0.0}, 0, False, 0.0, 0.0, tracked)


def test_warm_once_the_tracked_blocks_have_been_at_their_bound():
    half = MAX_TRACKED_BLOCKS / 2
    points = [
        point(10, half, MAX_FINGERPRINTS / 2),
        point(20, MAX_TRACKED_BLOCKS - 100, MAX_FINGERPRINTS / 2),  # 99.5 % of the bound
        point(30, half, MAX_FINGERPRINTS / 2),  # its older half dropped
    ]
    assert filled_at(points) == 20 * 60
    assert filled_at(points[:1]) is None  # never full: not warmed up


def test_the_slope_is_a_fitted_line_through_a_sawtooth():
    hours = [i / 10 for i in range(21)]
    flat_teeth = [50.0 + (0.4 if i and i % 5 == 0 else 0.0) for i in range(21)]  # ends on a tooth
    assert abs(_slope(hours, flat_teeth)) < 0.1
    assert (flat_teeth[-1] - flat_teeth[0]) / 2 > 0.1  # what the end points alone would say
    assert abs(_slope(hours, [50.0 + h for h in hours]) - 1.0) < 1e-9
    assert _slope([0.0], [50.0]) == 0.0
