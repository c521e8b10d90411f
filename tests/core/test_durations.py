"""The one duration grammar and format of the package (durations.py)."""

import pytest

from kvcache_exporter.durations import format_duration, parse_duration, window_label


@pytest.mark.parametrize(
    "text,seconds",
    [
        ("90s", 90),
        ("1m30s", 90),
        ("1h", 3600),
        ("500ms", 0.5),
        ("1.5s", 1.5),
        ("2w", 1_209_600),
        ("1d", 86400),
    ],
)
def test_parses_prometheus_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("bad", ["5", 5, 5.0, "", "5x", "30s1m", "1m1m", "0s", "-1s", None, True, [], "5 s"])
def test_refuses_what_is_not_one(bad):
    with pytest.raises(ValueError):
        parse_duration(bad)


def test_a_bare_number_says_what_to_write():
    with pytest.raises(ValueError, match='write "5s" for seconds'):
        parse_duration("5")


@pytest.mark.parametrize("seconds", [0.001, 0.5, 1, 59, 60, 61, 100, 3600, 5400, 86400, 90061.5])
def test_format_reads_back(seconds):
    assert parse_duration(format_duration(seconds)) == pytest.approx(seconds)


def test_window_labels_in_promql_style():
    assert [window_label(s) for s in (60, 300, 3600, 100, 0.5, 604800)] == [
        "1m",
        "5m",
        "1h",
        "1m40s",
        "500ms",
        "7d",
    ]
