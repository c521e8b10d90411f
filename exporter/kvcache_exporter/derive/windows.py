"""Sliding windows over a bounded history of polls, with counter resets handled like rate().

Each poll is stored as reset-adjusted running totals: a counter that goes down (or whose
vLLM process restarted) is taken to have restarted from zero, so its new value is all
increase. The increase over any window is then one subtraction, never negative.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from dataclasses import dataclass

from ..sources.vllm import EngineSample, Histogram


@dataclass(frozen=True)
class Point:
    ts: float
    counters: dict[str, float]  # reset-adjusted running totals
    histograms: dict[str, Histogram]  # reset-adjusted running counts and sum


@dataclass(frozen=True)
class Delta:
    """What happened between two polls."""

    seconds: float
    counters: dict[str, float]
    histograms: dict[str, Histogram]  # increases over the window


def advance(previous: float | None, previous_total: float, value: float, restarted: bool) -> float:
    """The next running total of a counter: rate() semantics for resets."""
    if previous is None:
        return value
    if restarted or value < previous:
        return previous_total + value
    return previous_total + value - previous


def _countable(value: float) -> bool:
    return 0 <= value < math.inf


def _good_histogram(hist: Histogram) -> bool:
    return _countable(hist.sum) and all(map(_countable, hist.counts))


def _countable_part(raw: EngineSample, last: EngineSample | None) -> EngineSample:
    """NaN, ±Inf or a negative counter would poison every window it is in, and stay there after the
    upstream recovers: such a value is replaced by the last good one (no increase), or left out."""
    if all(map(_countable, raw.counters.values())) and all(map(_good_histogram, raw.histograms.values())):
        return raw  # the usual case: nothing to copy
    counters = {}
    for name, value in raw.counters.items():
        if _countable(value):
            counters[name] = value
        elif last is not None and name in last.counters:
            counters[name] = last.counters[name]
    histograms = {}
    for name, hist in raw.histograms.items():
        if _good_histogram(hist):
            histograms[name] = hist
        elif last is not None and name in last.histograms:
            histograms[name] = last.histograms[name]
    return EngineSample(counters, raw.gauges, histograms, raw.start_time)


class SeriesHistory:
    """The polls of one (model_name, engine), kept for `retention` seconds."""

    def __init__(self, retention: float):
        self.retention = retention
        self.points: deque[Point] = deque()
        self._times: deque[float] = deque()  # the points' timestamps, for bisect
        self._windows: dict[float, Delta | None] = {}  # this poll's windows, asked for by several derivations
        self._last_raw: EngineSample | None = None

    def append(self, ts: float, raw: EngineSample) -> None:
        raw = _countable_part(raw, self._last_raw)
        last, prev = self._last_raw, self.points[-1] if self.points else None
        restarted = (
            last is not None and raw.start_time is not None and last.start_time not in (None, raw.start_time)
        )
        counters = {
            name: advance(
                last.counters.get(name) if last else None,
                prev.counters.get(name, 0.0) if prev else 0.0,
                value,
                restarted,
            )
            for name, value in raw.counters.items()
        }
        histograms = {}
        for name, hist in raw.histograms.items():
            before = last.histograms.get(name) if last else None
            total = prev.histograms.get(name) if prev else None
            if before is None or total is None or before.bounds != hist.bounds:
                if before is not None and before.bounds != hist.bounds:
                    self._forget(name)  # bucket layout changed: old points cannot be compared
                histograms[name] = hist
                continue
            reset = restarted or hist.count < before.count
            histograms[name] = Histogram(
                hist.bounds,
                tuple(
                    advance(b, t, c, reset)
                    for b, t, c in zip(before.counts, total.counts, hist.counts, strict=True)
                ),
                advance(before.sum, total.sum, hist.sum, reset),
            )
        self.points.append(Point(ts, counters, histograms))
        self._times.append(ts)
        self._windows.clear()
        self._last_raw = raw
        while self.points and self.points[0].ts < ts - self.retention:
            self.points.popleft()
            self._times.popleft()

    def _forget(self, histogram: str) -> None:
        for point in self.points:
            point.histograms.pop(histogram, None)

    def window(self, seconds: float) -> Delta | None:
        if seconds not in self._windows:
            self._windows[seconds] = self._window(seconds)
        return self._windows[seconds]

    def _window(self, seconds: float) -> Delta | None:
        """The delta from the newest poll at or before now-seconds (else the oldest) to the latest.

        A series that appeared later (or whose bucket layout changed) is measured from its
        first poll inside the window.
        """
        if len(self.points) < 2:
            return None
        latest = self.points[-1]
        start = max(bisect.bisect_right(self._times, latest.ts - seconds) - 1, 0)
        if latest.ts <= self.points[start].ts:
            return None

        def candidates():  # usually the first one has every series: stay lazy
            return itertools.islice(self.points, start, len(self.points) - 1)

        counters, histograms = {}, {}
        for name, value in latest.counters.items():
            base = next((p for p in candidates() if name in p.counters), None)
            if base is not None:
                counters[name] = value - base.counters[name]
        for name, hist in latest.histograms.items():
            base = next((p for p in candidates() if _bounds(p, name) == hist.bounds), None)
            if base is not None:
                before = base.histograms[name]
                histograms[name] = Histogram(
                    hist.bounds,
                    tuple(c - b for c, b in zip(hist.counts, before.counts, strict=True)),
                    hist.sum - before.sum,
                )
        return Delta(latest.ts - self.points[start].ts, counters, histograms)


def _bounds(point: Point, histogram: str) -> tuple[float, ...] | None:
    hist = point.histograms.get(histogram)
    return None if hist is None else hist.bounds
