"""Sliding windows over a bounded history of polls, with counter resets handled like rate().

Each poll is stored as reset-adjusted running totals: a counter that goes down (or whose
vLLM process restarted) is taken to have restarted from zero, so its new value is all
increase. The increase over any window is then one subtraction, never negative.

Memory (docs/memory.md): a point is one array of doubles (8 bytes per counter, per bucket and
per histogram sum) under a layout of names shared by every point with the same series, and the
history is thinned with age: a point of age `a` is dropped while its neighbours are closer than
a / RESOLUTION, so a window of any length w starts within w / RESOLUTION of now - w and the
number of points grows with the log of the retention, not with retention / interval.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import zlib
from array import array
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

from ..sources.vllm_snapshot import EngineSample, Histogram

RESOLUTION = 60  # a window's start is within 1/60 of its length


class Layout:
    """Where each series sits in a point's values: counters first, then each histogram's counts
    and its sum. Shared by every point with the same series (one object per layout)."""

    __slots__ = ("counters", "histograms", "zeros")

    def __init__(self, counters: tuple[str, ...], histograms: tuple[tuple[str, tuple[float, ...]], ...]):
        self.counters: dict[str, int] = {name: i for i, name in enumerate(counters)}
        self.histograms: dict[str, tuple[int, tuple[float, ...]]] = {}
        self.zeros: dict[str, Histogram] = {}  # a histogram that did not move: its zero delta, made once
        at = len(counters)
        for name, bounds in histograms:
            self.histograms[name] = (at, bounds)
            at += len(bounds) + 1


# Raw deflate with a 2 KiB window and a small state (~10 KB, not zlib's default ~270 KB a call).
_WBITS, _MEM_LEVEL = -11, 2


def _deflate(values: array | memoryview) -> bytes:
    packer = zlib.compressobj(1, zlib.DEFLATED, _WBITS, _MEM_LEVEL)
    return packer.compress(values) + packer.flush()


class Point:
    """One poll's running totals, deflated: histograms' cumulative buckets repeat one count for
    most of their length, so vLLM 0.32's 1.7 KB of doubles pack to ~0.2 KB (docs/memory.md). A
    window reads two points (~1.5 us to unpack each); the doubles round-trip bit for bit.

    With `shared` (the deflated values[split:], which the last point already holds: histograms
    that did not move), the first `split` doubles (the counters) are kept as they are and the
    rest is that one bytes object: deflating 1.7 KB was a fifth of a quiet poll's history work."""

    __slots__ = ("head", "layout", "packed", "ts")

    def __init__(self, ts: float, layout: Layout, values: array, split: int = 0, shared: bytes | None = None):
        self.ts, self.layout = ts, layout
        if shared is None:
            self.head, self.packed = b"", _deflate(values)
        else:
            self.head, self.packed = values[:split].tobytes(), shared

    @property
    def values(self) -> array:
        values = array("d", self.head)
        values.frombytes(zlib.decompress(self.packed, _WBITS))
        return values

    def counter(self, name: str) -> float | None:
        i = self.layout.counters.get(name)
        return None if i is None else self.values[i]

    def histogram(self, name: str) -> Histogram | None:
        found = self.layout.histograms.get(name)
        if found is None:
            return None
        at, bounds = found
        values = self.values
        return Histogram(bounds, tuple(values[at : at + len(bounds)]), values[at + len(bounds)])

    @property
    def counters(self) -> dict[str, float]:
        values = self.values
        return {name: values[i] for name, i in self.layout.counters.items()}

    @property
    def histograms(self) -> dict[str, Histogram]:
        return {name: h for name in self.layout.histograms if (h := self.histogram(name)) is not None}


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


def _all_countable(values: Collection[float]) -> bool:
    """Every value countable, without a call per value (a NaN, which min and max skip or keep at
    random, is looked for on its own)."""
    return not values or (min(values) >= 0 and max(values) < math.inf and not any(map(math.isnan, values)))


def _good_histogram(hist: Histogram) -> bool:
    return _countable(hist.sum) and _all_countable(hist.counts)


def _countable_part(raw: EngineSample, last: EngineSample | None) -> EngineSample:
    """NaN, ±Inf or a negative counter would poison every window it is in, and stay there after the
    upstream recovers: such a value is replaced by the last good one (no increase), or left out."""
    kept = last.histograms if last is not None else {}
    histograms = raw.histograms
    if _all_countable(raw.counters.values()) and (
        all(map(operator.is_, map(kept.get, histograms), histograms.values()))
        or all(h is kept.get(name) or _good_histogram(h) for name, h in histograms.items())
    ):  # a histogram object kept last poll was checked then
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


def _carry_missing(raw: EngineSample, last: EngineSample) -> EngineSample:
    """A series absent from one poll (a cut body, a family vLLM skipped) keeps its last value: no
    increase. Dropping it would restart its running total at the raw value when it came back, and
    every window across the gap would read a negative increase."""
    if last.counters.keys() <= raw.counters.keys() and last.histograms.keys() <= raw.histograms.keys():
        return raw
    return EngineSample(
        {**last.counters, **raw.counters}, raw.gauges, {**last.histograms, **raw.histograms}, raw.start_time
    )


class SeriesHistory:
    """The polls of one (model_name, engine), kept for `retention` seconds, thinned with age."""

    def __init__(self, retention: float, resolution: int = RESOLUTION):
        self.retention = retention
        self.resolution = resolution
        self.points: deque[Point] = deque()
        self._times: deque[float] = deque()  # the points' timestamps, for bisect
        self._windows: dict[float, Delta | None] = {}  # this poll's windows, asked for by several derivations
        self._from: dict[int, Delta] = {}  # this poll's deltas by start point: windows may share one
        self._last_raw: EngineSample | None = None
        self._raws: dict[str, float] = {}
        self._totals: dict[str, float] = {}
        self._raw_histograms: dict[str, Histogram] = {}
        self._histogram_totals: dict[str, Histogram] = {}
        self._layouts: dict[tuple, Layout] = {}
        self._histogram_part: tuple[tuple[Histogram, ...], array] = ((), array("d"))  # see _histogram_values
        self._shared: tuple[array | None, bytes | None] = (None, None)  # a histogram part, deflated alone
        self._layout: tuple[tuple, tuple, Layout | None] = ((), (), None)  # the last point's, by its names
        self._changed: dict[str, float] = {}  # histogram -> when its running totals last moved
        self._appended = 0
        self._unpacked: tuple[Point | None, array] = (None, array("d"))  # the newest, for every window

    def append(self, ts: float, raw: EngineSample) -> None:
        raw = _countable_part(raw, self._last_raw)
        last = self._last_raw
        restarted = (
            last is not None and raw.start_time is not None and last.start_time not in (None, raw.start_time)
        )
        if last is not None and not restarted:
            raw = _carry_missing(raw, last)
        # Totals and the raw values they advance from carry over polls a series was absent from
        # (a cut body, a restart that dropped it), so a running total never goes down.
        raws, totals = self._raws, self._totals
        counters = {}
        for name, value in raw.counters.items():  # advance(), inline: a call per counter and poll
            before = raws.get(name)
            if before is None:
                counters[name] = value
            elif restarted or value < before:
                counters[name] = totals.get(name, 0.0) + value
            else:
                counters[name] = totals.get(name, 0.0) + value - before
        self._totals.update(counters)
        self._raws.update(raw.counters)
        if not restarted and all(
            map(operator.is_, map(self._raw_histograms.get, raw.histograms), raw.histograms.values())
        ):
            # every histogram the same object as last poll (the source's "nothing moved"): what
            # _advance_histograms would give, in one pass
            totals_of = self._histogram_totals
            histograms = {name: totals_of[name] for name in raw.histograms}
        else:
            histograms = self._advance_histograms(ts, raw, restarted)
        self._unpacked = self._point(ts, counters, histograms)
        self.points.append(self._unpacked[0])
        self._times.append(ts)
        self._windows.clear()
        self._from.clear()
        self._last_raw = raw
        # keep the newest point at or before the cutoff: a window as long as the retention is covered
        while len(self.points) > 1 and self.points[1].ts <= ts - self.retention:
            self.points.popleft()
            self._times.popleft()
        self._appended += 1
        if self._appended % 16 == 0:
            self._thin(ts)

    def _advance_histograms(self, ts: float, raw: EngineSample, restarted: bool) -> dict[str, Histogram]:
        """Each histogram's running totals after `raw`."""
        histograms = {}
        for name, hist in raw.histograms.items():
            before, total = self._raw_histograms.get(name), self._histogram_totals.get(name)
            if hist is before and total is not None and not restarted:
                histograms[name] = total  # the source handed the same object: nothing changed
                continue
            self._changed[name] = ts
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
        self._raw_histograms.update(raw.histograms)
        self._histogram_totals.update(histograms)
        return histograms

    def _point(
        self, ts: float, counters: dict[str, float], histograms: dict[str, Histogram]
    ) -> tuple[Point, array]:
        totals = tuple(histograms.values())
        part = self._histogram_values(totals)
        names, hnames, layout = self._layout
        if (
            layout is None
            or names != tuple(counters)
            or hnames != tuple(histograms)
            or part is not self._shared[0]
        ):
            key = (tuple(counters), tuple((name, h.bounds) for name, h in histograms.items()))
            layout = self._layouts.get(key)
            if layout is None:
                layout = self._layouts[key] = Layout(*key)
            self._layout = (key[0], tuple(histograms), layout)
        values = array("d", counters.values())
        values.extend(part)
        shared_part, shared = self._shared
        if part is not shared_part:  # a histogram moved: this point deflated whole, as one
            self._shared = (part, None)
            return Point(ts, layout, values), values
        if shared is None:
            shared = _deflate(part)
            self._shared = (part, shared)
        return Point(ts, layout, values, len(counters), shared), values

    def _histogram_values(self, totals: tuple[Histogram, ...]) -> array:
        """Each histogram's counts and its sum, in order: the last poll's array while the running
        totals are the same objects (histograms that did not move are handed on as such)."""
        last, values = self._histogram_part
        if len(totals) != len(last) or not all(map(operator.is_, totals, last)):
            values = array("d")
            for h in totals:
                values.extend(h.counts)
                values.append(h.sum)
            self._histogram_part = (totals, values)
        return values

    def _thin(self, now: float) -> None:
        """Drop each point whose neighbours stay within age / resolution of each other without it."""
        if len(self.points) <= self.resolution:
            return
        kept = [self.points[0]]
        points = self.points
        for i in range(1, len(points) - 1):
            if points[i + 1].ts - kept[-1].ts > (now - points[i].ts) / self.resolution:
                kept.append(points[i])
        kept.append(points[-1])
        if len(kept) < len(points):
            self.points = deque(kept)
            self._times = deque(p.ts for p in kept)
        if len(self._layouts) > 8:  # layouts no point uses any more
            live = {id(p.layout) for p in kept}
            self._layouts = {k: v for k, v in self._layouts.items() if id(v) in live}

    def _forget(self, histogram: str) -> None:
        made: dict[int, Layout] = {}  # not interned: their offsets are those of the older layout
        for point in self.points:
            if histogram in point.layout.histograms:
                if id(point.layout) not in made:
                    made[id(point.layout)] = _sublayout(point.layout, histogram)
                point.layout = made[id(point.layout)]

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
        delta = self._from.get(start)
        if delta is None:
            delta = self._from[start] = self._delta(start)
        return delta

    def _delta(self, start: int) -> Delta:
        latest = self.points[-1]
        first = self.points[start]
        if first.layout is latest.layout:  # the usual case: the same series all along
            still = {name for name, ts in self._changed.items() if ts <= first.ts}
            unpacked, values = self._unpacked
            return _whole_delta(latest, values if unpacked is latest else latest.values, first, still)

        def candidates():  # usually the first one has every series: stay lazy
            return itertools.islice(self.points, start, len(self.points) - 1)

        counters, histograms = {}, {}
        values = latest.values
        for name, i in latest.layout.counters.items():
            base = next((p for p in candidates() if name in p.layout.counters), None)
            if base is not None:
                counters[name] = values[i] - base.values[base.layout.counters[name]]
        for name, (_, bounds) in latest.layout.histograms.items():
            base = next((p for p in candidates() if _bounds(p, name) == bounds), None)
            if base is not None:
                hist, before = latest.histogram(name), base.histogram(name)
                histograms[name] = Histogram(
                    bounds,
                    tuple(c - b for c, b in zip(hist.counts, before.counts, strict=True)),
                    hist.sum - before.sum,
                )
        return Delta(latest.ts - self.points[start].ts, counters, histograms)


def _whole_delta(latest: Point, now: array, base: Point, still: set[str]) -> Delta:
    """The delta of two points with one layout (`now` is `latest`'s values, unpacked already): one
    subtraction per counter and per bucket of a histogram that moved. A histogram in `still` has
    not moved since `base` was taken: its delta is zero, one shared object."""
    then = base.values  # one layout: the same offsets
    layout = latest.layout
    counters = {name: now[i] - then[i] for name, i in layout.counters.items()}
    histograms = {}
    for name, (at, bounds) in layout.histograms.items():
        if name in still:
            zero = layout.zeros.get(name)
            if zero is None:
                zero = layout.zeros[name] = Histogram(bounds, (0.0,) * len(bounds), 0.0)
            histograms[name] = zero
        else:
            end = at + len(bounds)
            counts = tuple(map(operator.sub, now[at:end], then[at:end]))
            histograms[name] = Histogram(bounds, counts, now[end] - then[end])
    return Delta(latest.ts - base.ts, counters, histograms)


def _bounds(point: Point, histogram: str) -> tuple[float, ...] | None:
    found = point.layout.histograms.get(histogram)
    return None if found is None else found[1]


def _sublayout(layout: Layout, histogram: str) -> Layout:
    """The layout without one histogram; the values array keeps its offsets for the others."""
    out = Layout((), ())
    out.counters = layout.counters
    out.histograms = {n: v for n, v in layout.histograms.items() if n != histogram}
    return out
