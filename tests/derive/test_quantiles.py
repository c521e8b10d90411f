import math

import pytest

from kvcache_exporter.derive.quantiles import histogram_quantile

INF = math.inf


def test_interpolates_inside_the_bucket_like_promql():
    # 10 observations: 2 in (0,1], 6 in (1,2], 2 in (2,4]
    bounds, counts = (1.0, 2.0, 4.0, INF), (2, 8, 10, 10)
    assert histogram_quantile(0.5, bounds, counts) == pytest.approx(1.5)  # rank 5: 1 + 1*(3/6)
    assert histogram_quantile(0.9, bounds, counts) == pytest.approx(3.0)  # rank 9: 2 + 2*(1/2)
    assert histogram_quantile(0.1, bounds, counts) == pytest.approx(0.5)  # rank 1 in the first bucket


def test_rank_in_the_inf_bucket_returns_the_highest_finite_bound():
    assert histogram_quantile(0.99, (1.0, 2.0, INF), (1, 2, 10)) == 2.0


def test_empty_histogram_and_missing_inf_bucket_have_no_value():
    assert histogram_quantile(0.5, (1.0, INF), (0, 0)) is None
    assert histogram_quantile(0.5, (1.0, 2.0), (1, 2)) is None
    assert histogram_quantile(1.5, (1.0, INF), (1, 1)) is None


def test_decreasing_buckets_are_repaired_with_the_running_maximum():
    # a scrape race left bucket 2 below bucket 1; PromQL treats it as 5, so rank 6 lands in (2, 4]
    assert histogram_quantile(0.6, (1.0, 2.0, 4.0, INF), (5, 3, 10, 10)) == pytest.approx(2.4)


def test_first_bucket_with_non_positive_bound_returns_that_bound():
    assert histogram_quantile(0.2, (0.0, 1.0, INF), (4, 10, 10)) == 0.0


@pytest.mark.parametrize("q", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_a_count_that_is_no_number_has_no_quantile(q, bad):
    """q=0 with an infinite count used to raise StopIteration (issue 14 item 2)."""
    assert histogram_quantile(q, (0.1, 1.0, math.inf), (1.0, 2.0, bad)) is None
