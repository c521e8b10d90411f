import pytest

from kvcache_exporter.derive.windows import SeriesHistory, advance
from kvcache_exporter.sources.vllm import EngineSample, Histogram

INF = float("inf")


def sample(queries, hits, start=100.0, hist=None):
    s = EngineSample(counters={"query_tokens": queries, "hit_tokens": hits}, start_time=start)
    if hist is not None:
        s.histograms["prefill"] = Histogram((0.5, 1.0, INF), hist, 0.0)
    return s


def test_advance_follows_rate_semantics():
    assert advance(None, 0, 50, False) == 50
    assert advance(50, 50, 80, False) == 80
    assert advance(80, 80, 10, False) == 90  # reset: the new value is all increase
    assert advance(10, 90, 30, True) == 120  # restart detected by start time: 30 more


def test_window_increase_spans_a_reset_without_going_negative():
    h = SeriesHistory(retention=3600)
    for ts, q, hits in [(0, 1000, 500), (10, 1100, 580), (20, 50, 40), (30, 150, 100)]:
        h.append(ts, sample(q, hits))
    delta = h.window(60)
    # increases: 100 + 50 (restart) + 100 = 250 queries; 80 + 40 + 60 = 180 hits
    assert delta.counters["query_tokens"] == 250
    assert delta.counters["hit_tokens"] == 180
    assert delta.seconds == 30


def test_restart_detected_from_start_time_even_when_the_counter_grew_past_its_old_value():
    h = SeriesHistory(retention=3600)
    h.append(0, sample(100, 50, start=1.0))
    h.append(10, sample(300, 100, start=2.0))  # restarted, then served 300 queries
    assert h.window(60).counters["query_tokens"] == 300


def test_a_counter_missing_from_one_poll_keeps_its_total():
    h = SeriesHistory(retention=3600)
    h.append(0, sample(1000, 500, hist=(1, 2, 3)))
    h.append(10, EngineSample(counters={"hit_tokens": 520}, start_time=100.0))  # a cut body
    h.append(20, sample(1100, 560, hist=(2, 3, 5)))
    delta = h.window(60)
    assert (delta.counters["query_tokens"], delta.counters["hit_tokens"]) == (100, 60)
    assert delta.histograms["prefill"].counts == (1, 1, 2)


def test_a_cut_body_that_also_reads_as_a_restart_never_gives_a_negative_increase():
    """Found by tests/derive/test_targets_fuzz.py: the cut body's start time differed, the counters
    it lacked restarted their totals at zero, and the next window read -2509 tokens."""
    h = SeriesHistory(retention=3600)
    h.append(0, sample(2509, 0, start=168.0))
    h.append(1, EngineSample(counters={}, start_time=144.0))
    h.append(2, sample(0, 0, start=168.0))
    h.append(3, sample(40, 10, start=168.0))
    for seconds in (1.5, 2.5, 60):
        assert all(v >= 0 for v in h.window(seconds).counters.values())
    assert h.window(60).counters["query_tokens"] == 40


def test_window_baseline_is_the_newest_poll_at_or_before_its_start():
    h = SeriesHistory(retention=3600)
    for ts in range(0, 130, 10):
        h.append(ts, sample(ts * 10, ts * 5))
    delta = h.window(60)
    assert delta.seconds == 60
    assert delta.counters["query_tokens"] == 600


def test_single_poll_and_empty_history_give_no_window():
    h = SeriesHistory(retention=3600)
    assert h.window(60) is None
    h.append(0, sample(10, 5))
    assert h.window(60) is None


def test_retention_bounds_the_history():
    h = SeriesHistory(retention=100)
    for ts in range(0, 1000, 5):
        h.append(ts, sample(ts, ts))
    assert len(h.points) == 21
    assert h.points[0].ts == 895


def test_histogram_bucket_deltas_and_resets():
    h = SeriesHistory(retention=3600)
    h.append(0, sample(0, 0, hist=(1, 2, 2)))
    h.append(10, sample(0, 0, hist=(3, 6, 7)))
    h.append(20, sample(0, 0, hist=(1, 1, 1)))  # restart: count fell
    hist = h.window(60).histograms["prefill"]
    bounds, counts = hist.bounds, hist.counts
    assert bounds == (0.5, 1.0, INF)
    assert counts == (3, 5, 6)  # (2,4,5) before the restart + (1,1,1) after


def test_bucket_layout_change_forgets_the_old_layout():
    h = SeriesHistory(retention=3600)
    h.append(0, sample(0, 0, hist=(1, 2, 2)))
    s = sample(0, 0)
    s.histograms["prefill"] = Histogram((0.1, 0.5, 1.0, INF), (1, 1, 2, 3), 0.0)
    h.append(10, s)
    assert "prefill" not in h.window(60).histograms  # nothing comparable yet
    s2 = sample(0, 0)
    s2.histograms["prefill"] = Histogram((0.1, 0.5, 1.0, INF), (2, 2, 4, 6), 0.0)
    h.append(20, s2)
    assert h.window(60).histograms["prefill"].counts == (1, 1, 2, 3)


@pytest.mark.parametrize(
    "hits,queries,expected", [(5, 10, 0.5), (0, 0, None), (3, None, None), (12, 10, 1.0)]
)
def test_hit_ratio_is_absent_without_queries_and_never_above_one(hits, queries, expected):
    from kvcache_exporter.derive.cache import hit_ratio

    assert hit_ratio(hits, queries) == expected


@pytest.mark.parametrize("interval", [1, 5])
def test_an_hour_of_polls_is_thinned_with_age_and_windows_stay_within_a_sixtieth(interval):
    h = SeriesHistory(retention=3600 + 2 * interval)
    for ts in range(0, 3 * 3600, interval):
        h.append(ts, sample(ts * 10, ts * 5))
    assert len(h.points) < {1: 500, 5: 320}[interval]  # 3,602 and 722 polls in the retention
    times = [p.ts for p in h.points]
    assert times[-60:] == list(range(3 * 3600 - 60 * interval, 3 * 3600, interval))  # the newest: every poll
    for window in (60, 300, 900, 3600):
        delta = h.window(window)
        assert window <= delta.seconds <= window * (1 + 1 / 60) + interval
        assert delta.counters["query_tokens"] == delta.seconds * 10  # exact over the span covered


def test_a_packed_point_gives_back_its_doubles_bit_for_bit_and_is_smaller():
    import random
    from array import array

    from kvcache_exporter.derive.windows import Layout, Point

    rng = random.Random(9)
    buckets = array("d", sorted(float(rng.randrange(10**9)) for _ in range(2000)))  # past the 2 KiB window
    sums = array("d", (rng.uniform(0, 1e6) for _ in range(100)))  # no repeats to pack
    for values in (buckets, sums, array("d", [0.0] * 212), array("d")):
        point = Point(1.0, Layout((), ()), values)
        assert point.values.tobytes() == values.tobytes()
    repeated = array("d", [7010.0] * 200)  # a histogram's top buckets
    assert len(Point(1.0, Layout((), ()), repeated).packed) < len(repeated.tobytes()) / 20


def test_points_of_quiet_histograms_share_their_packed_part_and_read_back_exactly():
    """Counters move every poll, histograms only now and then: a point whose histograms did not move
    keeps its counters as they are and the last point's deflated histograms (one bytes object)."""
    import math
    from array import array

    from kvcache_exporter.derive.windows import Point

    h = SeriesHistory(retention=3600.0)
    hist = Histogram((1.0, math.inf), (3.0, 5.0), 7.5)
    samples = []
    for i in range(8):
        if i == 5:
            hist = Histogram((1.0, math.inf), (4.0, 9.0), 11.25)
        samples.append(EngineSample({"query_tokens": 10.0 * i, "hit_tokens": 3.0 * i}, {}, {"ttft": hist}))
        h.append(float(i), samples[-1])
    packed = [p.packed for p in h.points]
    assert packed[2] is packed[3] is packed[4] and packed[6] is packed[7]  # shared while quiet
    assert packed[0] is not packed[1] and packed[5] is not packed[6]  # moved: deflated whole
    for point, sample in zip(h.points, samples, strict=True):
        assert point.counters == sample.counters
        assert point.histograms == sample.histograms
    assert h.window(5.0).counters == {"query_tokens": 50.0, "hit_tokens": 15.0}
    assert h.window(5.0).histograms["ttft"] == Histogram((1.0, math.inf), (1.0, 4.0), 3.75)
    values = array("d", [1.5, -0.0, math.inf, 2.0, 3.0])
    shared = Point(0.0, h.points[0].layout, values[2:]).packed
    assert Point(0.0, h.points[0].layout, values, 2, shared).values.tobytes() == values.tobytes()
