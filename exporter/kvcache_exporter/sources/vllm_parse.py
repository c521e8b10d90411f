"""Normalize one vLLM /metrics exposition into a VllmSnapshot (pure: text in, snapshot out).

Every naming generation (V1, deprecated V1, V0, `ray_vllm:`) maps onto the same logical
quantities per (model_name, engine); see vllm_names.py. vLLM serves ~45 families and ~700 lines
of which about a third are read: one regex pass (textformat.family_runs) finds the runs of lines
of the families read or named (schema, deprecation and missing-metric checks); the others are
never split or looked at. A source keeps a Memory between polls, since vLLM serves the same
series every time: the runs are found where the last body had them (textformat.RunFinder, no
regex pass while the rest of the body is the same), a run whose text did not change adds what
it added last time (a histogram's buckets: one dict copy), and a line seen before costs a dict
lookup and a float(). A body that differs from the last one only in the values of counter and
gauge lines, each the one line its engine's series is read from (an idle vLLM's page, or one
whose histograms did not move), is the last snapshot with those values put in (`_patch`): no
run is read again.
"""

from __future__ import annotations

import math
import re
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from . import textformat
from . import vllm_names as names
from .base import SourceError
from .vllm_snapshot import EngineKey, EngineSample, Histogram, VllmSnapshot


@dataclass(frozen=True)
class ParseBounds:
    max_samples: int = 200_000
    max_labels: int = 128
    max_engines: int = 192  # with 1 h of history at 1 s polls, ~105 MiB in all (docs/memory.md)
    max_line_chars: int = 16 * 1024  # vLLM's longest line (cache_config_info) is ~1.1 KiB


class Series:
    """What a sample line the exporter reads means, without its value."""

    __slots__ = ("bound", "config", "hkey", "key", "kind", "logical", "name")  # not the labels: memory

    def __init__(self, name: str, labels: dict[str, str], shared: dict[tuple, tuple]):
        # A family's bucket lines share one name, engine key and hkey: `shared` (the Memory's)
        # holds one copy of each, ~90 KB less per vLLM 0.32 source than a copy per line.
        self.name = sys.intern(name)
        key = (sys.intern(labels.get("model_name", "")), sys.intern(labels.get("engine", "0")))
        self.key: EngineKey = shared.setdefault(key, key)
        self.kind, self.logical = _kind(name, labels)
        hkey = (self.key, self.logical)  # where a bucket, sum or gauge part accumulates
        self.hkey = shared.setdefault(hkey, hkey)
        self.bound = _bound(name, labels) if self.kind == "bucket" else 0.0
        self.config = _config(labels) if self.kind == "config" else None


class Run:
    """What one run of a family's consecutive lines added to a scrape: its samples in order, and
    for a run of bucket lines only (most of what is read) their sums per histogram, so that a run
    seen again is one dict copy per histogram instead of one `take` per line."""

    __slots__ = ("buckets", "keys", "lines", "samples", "sorted", "text")

    def __init__(self, text: str, lines: int, samples: list[tuple[Series, float]]):
        self.text, self.lines, self.samples = text, lines, samples
        self.buckets: dict[tuple, dict[float, float]] | None = None
        self.sorted: dict[tuple, tuple[tuple[float, ...], tuple[float, ...]]] = {}  # (bounds, counts)
        self.keys: list[EngineKey] = []
        if samples and all(s.kind == "bucket" for s, _ in samples):
            self.buckets = {}
            for s, value in samples:  # in order, from 0.0: the same float sums as take()'s
                counts = self.buckets.get(s.hkey)
                if counts is None:
                    counts = self.buckets[s.hkey] = defaultdict(float)
                    if s.key not in self.keys:
                        self.keys.append(s.key)
                counts[s.bound] += value

    def ordered(self, hkey: tuple) -> tuple[tuple[float, ...], tuple[float, ...]]:
        """A histogram's bounds in order and their counts, sorted once per run text, not per poll."""
        done = self.sorted.get(hkey)
        if done is None:
            counts = self.buckets[hkey]  # type: ignore[index]
            bounds = tuple(sorted(counts))
            done = self.sorted[hkey] = (bounds, tuple(map(counts.__getitem__, bounds)))
        return done


class Memory:
    """What one source remembers between polls: the runs of the last poll by family name (a run is
    reused only when its text is the same), and each sample line's head (the text before its last
    space) -> its Series, or just its name for a family the exporter does not read. A head is
    remembered only from a line whose value ran from there to its end, and a remembered head only
    ever meets the text after a line's last space, so a hit means exactly what a full parse
    would. Forgets everything past `max_entries` heads; one Memory per source (not thread-safe,
    and a source's polls never overlap)."""

    def __init__(self, max_entries: int = 50_000, max_run_chars: int = 1 << 20):
        self.max_entries = max_entries
        self.max_run_chars = max_run_chars  # vLLM 0.32: ~25 KB of runs per engine
        self.runs: dict[str, Run] = {}  # the last successful poll's, by family name as written
        self.histograms: dict[tuple, Histogram] = {}  # the last poll's, by (engine key, logical)
        self.heads: dict[str, Series | str] = {}
        self.bounds: dict[tuple[float, ...], tuple[float, ...]] = {}  # one tuple per bucket layout
        self.values: dict[str, float] = {}  # value texts already read ("0.0", "42.0": most buckets)
        self.shared: dict[tuple, tuple] = {}  # one copy of each Series key (see Series)
        self.finder = textformat.RunFinder((_RUNS[False], _RUNS[True]), _RAY, max_run_chars)
        self.last: _Last | None = None  # the last poll's, when it parsed: what `_patch` starts from

    def bound(self) -> None:
        if len(self.heads) >= self.max_entries or len(self.bounds) > 1000:
            self.heads.clear()
            self.bounds.clear()
            self.shared.clear()
            self.histograms.clear()
        if len(self.histograms) > 4096:  # engines come and go
            self.histograms.clear()
        if len(self.values) > 600:  # counters make new ones every poll; ~60 KB at most
            self.values.clear()

    def read(self, line: str, limits: ParseBounds) -> tuple[Series | str, float]:
        """The line's Series and value, or its name (value NaN) when its family is not read."""
        head, space, tail = line.rpartition(" ")
        known = self.heads.get(head) if space else None
        if type(known) is str:
            return known, math.nan
        if known is not None:
            value = self.values.get(tail)
            if value is not None:
                return known, value
            if "\t" not in tail:
                try:
                    value = self.values[tail] = textformat.parse_value(tail)
                    return known, value
                except ValueError:
                    pass  # the full parse says what is wrong
        name = _normal((head if space else line).split("{", 1)[0].split(" ", 1)[0].split("\t", 1)[0])
        if _base(name) not in _WANTED_BASES:
            if space:
                self.heads[head] = sys.intern(name)  # one copy per family, not per line
            return name, math.nan
        if len(line) > limits.max_line_chars:  # bounds the regex work (and the GIL) per line
            raise SourceError("parse_error", f"a {name} line is longer than {limits.max_line_chars} chars")
        parsed, head = textformat.parse_line_and_head(line)
        if len(parsed.labels) > limits.max_labels:
            raise SourceError("too_many_labels", f"{name} has {len(parsed.labels)} labels")
        series = Series(_normal(parsed.name), parsed.labels, self.shared)
        if head is not None:
            self.heads[head] = series
        return series, parsed.value


_RAY = "ray_vllm:"


def _normal(name: str) -> str:
    return "vllm:" + name[len(_RAY) :] if name.startswith(_RAY) else name


_SUFFIXES = ("_total", "_created", "_bucket", "_count", "_sum", "_info")


def _base(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


_COUNTER_OF = {name: logical for logical, cands in names.COUNTERS.items() for name in cands}
_GAUGE_OF = {name: logical for logical, cands in names.GAUGES.items() for name in cands}
_BLOCK_COUNTABLE = {"vllm:gpu_prefix_cache_queries_total", "vllm:gpu_prefix_cache_hits_total"}
_HIST_OF = {
    f"{base}{suffix}": logical for logical, base in names.HISTOGRAMS.items() for suffix in ("_bucket", "_sum")
}
_WANTED_BASES = {
    _base(n)
    for n in (*_COUNTER_OF, *_GAUGE_OF, *_HIST_OF, names.PROMPT_BY_SOURCE, names.CACHE_CONFIG, names.CREATED,
              names.PROCESS_START, names.CACHED_BY_TIER, names.WAITING_BY_REASON,
              names.ADMISSION_REJECTIONS)
}  # fmt: skip
_READ = {n for b in _WANTED_BASES for n in (b, *(b + x for x in _SUFFIXES)) if _base(n) in _WANTED_BASES}
_NORMAL: dict[str, str] = {}  # a run's name as written -> _normal's: bounded, as _RUNS matches only these
_RUNS = {ray: textformat.family_runs(_READ | names.DEPRECATED, ray) for ray in (False, True)}
_ANY_VLLM_LINE = re.compile(r"\n(?:ray_)?vllm:")
_HELP_IN_BLOCKS = re.compile(r"\n# HELP ((?:ray_)?vllm:gpu_prefix_cache_(?:queries|hits)_total) [^\n]*blocks")


def _kind(name: str, labels: dict[str, str]) -> tuple[str | None, str | None]:
    if name in _COUNTER_OF:
        return "counter", _COUNTER_OF[name]
    if name == names.PROMPT_BY_SOURCE:
        return (
            ("counter", "computed_prompt_tokens")
            if labels.get("source") == names.COMPUTED_SOURCE
            else (None, None)
        )
    if name == names.CACHED_BY_TIER:
        tier = labels.get("source")
        return ("counter", f"cached_tier_{tier}") if tier in names.TIERS else (None, None)
    if name == names.WAITING_BY_REASON:
        reason = labels.get("reason")
        return ("gauge", f"waiting_{reason}") if reason in names.WAITING_REASONS else (None, None)
    if name == names.ADMISSION_REJECTIONS:
        reason = labels.get("reason")
        return ("counter", f"rejected_{reason}") if reason in names.ADMISSION_REASONS else (None, None)
    if name in _GAUGE_OF:
        return "gauge", _GAUGE_OF[name]
    if name in _HIST_OF:
        return ("bucket" if name.endswith("_bucket") else "sum"), _HIST_OF[name]
    if name == names.CACHE_CONFIG:
        return "config", None
    if name == names.CREATED:
        return "created", None
    if name == names.PROCESS_START:
        return "process_start", None
    return None, None  # read for its syntax only (e.g. a histogram's _count)


def _bound(name: str, labels: dict[str, str]) -> float:
    if "le" not in labels:
        raise ValueError(f"{name} has no le label")
    bound = float(labels["le"])  # ValueError on text that is no number
    if math.isnan(bound):
        raise ValueError(f"{name} has le={labels['le']!r}")
    return bound


# cache_config_info labels the exporter computes with; "None" means unset, other text is ignored.
_CONFIG_NUMBERS = ("num_gpu_blocks", "block_size", "kv_cache_size_tokens", "kv_cache_memory_bytes")


def _config(labels: dict[str, str]) -> dict[str, str]:
    """The labels, with a number that cannot be a size (NaN, inf, negative) read as unset: the
    engine keeps its other series, the block and capacity series it would corrupt are absent."""
    config = dict(labels)
    for key in _CONFIG_NUMBERS:
        try:
            number = float(config.get(key, "None"))
        except ValueError:
            continue
        if not (math.isfinite(number) and number >= 0):
            config[key] = "None"
    return config


class _Accumulator:
    """Collects the wanted samples of one scrape, keyed by (model_name, engine)."""

    def __init__(self, limits: ParseBounds):
        self.limits = limits
        self.engines: dict[EngineKey, EngineSample] = {}
        self.gauge_parts: dict[tuple[EngineKey, str], list[float]] = defaultdict(list)
        self.buckets: dict[tuple[EngineKey, str], dict[float, float]] = defaultdict(
            lambda: defaultdict(float)
        )
        self.sums: dict[tuple[EngineKey, str], float] = defaultdict(float)
        # A histogram whose buckets all came from one run seen before: its bucket dict is that
        # run's (not copied; `take` copies it before adding to it) and its (bounds, counts) sorted.
        self.borrowed: dict[tuple[EngineKey, str], tuple[tuple[float, ...], tuple[float, ...]]] = {}
        self.cache_configs: dict[str, dict[str, str]] = {}
        self.process_start: float | None = None
        self.chosen: dict[str, str] = {}  # logical -> the candidate name in use
        # (engine key, logical) -> the Series of the one counter or gauge line it was taken from,
        # or _MANY: where `_patch` may put a line's new value in as the series' value
        self.taken: dict[tuple, Series | str] = {}

    def engine(self, key: EngineKey) -> EngineSample:
        sample = self.engines.get(key)
        if sample is None:
            if len(self.engines) >= self.limits.max_engines:
                raise SourceError(
                    "too_many_series", f"more than {self.limits.max_engines} (model, engine) pairs"
                )
            sample = self.engines[key] = EngineSample()
        return sample

    def take(self, s: Series, value: float) -> None:
        """Add one sample. ValueError (-> parse_error) where a count is impossible: windows over a
        NaN, infinite or negative counter would be wrong for as long as they hold it."""
        kind = s.kind
        if kind == "bucket":  # most of the lines read: kept short
            if s.key not in self.engines:
                self.engine(s.key)
            if s.hkey in self.borrowed:
                del self.borrowed[s.hkey]
                self.buckets[s.hkey] = defaultdict(float, self.buckets[s.hkey])
            self.buckets[s.hkey][s.bound] += value if 0 <= value < math.inf else _count(s.name, value)
        elif kind == "counter":
            if self.chosen.setdefault(s.logical, s.name) == s.name:
                counters = self.engine(s.key).counters
                counters[s.logical] = counters.get(s.logical, 0.0) + _count(s.name, value)
                self.taken[s.hkey] = _MANY if s.hkey in self.taken else s
        elif kind == "sum":
            self.engine(s.key)
            self.sums[s.hkey] += _count(s.name, value)
        elif kind == "gauge":
            # A gauge that is no number, or a negative count, is dropped: it then reads as missing.
            # (V0's hit-rate gauge says -1 for "no data"; derive/cache.py drops that at export.)
            if _usable(s.logical, value) and self.chosen.setdefault(s.logical, s.name) == s.name:
                self.engine(s.key)
                self.gauge_parts[s.hkey].append(value)
                self.taken[s.hkey] = _MANY if s.hkey in self.taken else s
        elif kind == "config":
            self.cache_configs[s.key[1]] = s.config
        elif kind == "created" and math.isfinite(value):
            self.engine(s.key).start_time = value
        elif kind == "process_start" and math.isfinite(value):
            self.process_start = value

    def add(self, run: Run) -> None:
        """A run seen before, whole: what its `take`s added then (its values all passed)."""
        if run.buckets is None or not run.buckets.keys().isdisjoint(self.buckets):
            for series, value in run.samples:
                self.take(series, value)
            return
        for key in run.keys:
            if key not in self.engines:
                self.engine(key)
        for hkey, counts in run.buckets.items():
            self.buckets[hkey] = counts
            self.borrowed[hkey] = run.ordered(hkey)


def _usable(logical: str, gauge: float) -> bool:
    return math.isfinite(gauge) and (gauge >= 0 or logical == "v0_block_hit_rate")


def _gauge(logical: str, parts: list[float]) -> float:
    total = sum(parts)
    return total / len(parts) if logical in names.RATIO_GAUGES else total


_MANY = "many"  # _Accumulator.taken: more than one line


def _count(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} is {value}: a count is a finite number >= 0")
    return value


def parse(
    text: str, limits: ParseBounds = ParseBounds(), memory: Memory | None = None, *, lead: bool = False
) -> VllmSnapshot:
    """Normalize one /metrics exposition ("\n" + one with `lead`: the runs are found by the line
    feed before each name). Raises SourceError("parse_error") on malformed text."""
    memory = memory or Memory()
    memory.bound()
    body = text if lead else "\n" + text
    found, ray = memory.finder.find(body)
    last, memory.last = memory.last, None
    if last is not None and memory.finder.moved is not None:
        patched = _patch(found, memory, last)
        if patched is not None:
            return patched
    prefix = _RAY if ray else "vllm:"
    acc = _Accumulator(limits)
    seen: set[str] = set()
    runs: dict[str, Run] = {}  # this poll's, for the next one
    kept = read = 0
    try:
        for run_text, written in found:
            name = _NORMAL.get(written) or _NORMAL.setdefault(written, _normal(written))
            seen.add(name)
            if name not in _READ:
                continue  # a deprecated name the exporter only counts
            run = memory.runs.get(written)
            if run is None or run.text != run_text:
                run = _read_run(run_text, memory, limits.max_samples - read, acc)
            elif run.samples and read + run.lines <= limits.max_samples:
                acc.add(run)
            read += run.lines
            if read > limits.max_samples:
                raise SourceError("too_many_series", f"more than {limits.max_samples} samples")
            if written not in runs and kept + len(run_text) <= memory.max_run_chars:
                runs[written] = run
                kept += len(run_text)
    except ValueError as err:
        raise SourceError("parse_error", f"malformed exposition: {err}") from err
    memory.runs = runs
    schema = names.schema_of(seen)
    if schema == "unknown" and _ANY_VLLM_LINE.search(body):
        schema = "v0"  # only vllm: families the exporter neither reads nor names
    if schema == "unknown":
        raise SourceError(
            "no_vllm_metrics", "the body holds no vllm: metrics; is --vllm.url a vLLM /metrics?"
        )
    block_counted = set()  # early-V1 prefix-cache counters whose HELP says they count blocks
    if seen & _BLOCK_COUNTABLE:
        block_counted = {_normal(m.group(1)) for m in _HELP_IN_BLOCKS.finditer(body)}
    engines, raw = _finish(acc, block_counted, memory)
    present = set(acc.chosen) | {k for e in engines.values() for k in e.histograms}
    if acc.cache_configs:
        present.add("cache_config")
    expected = names.EXPECTED_V0 if schema == "v0" else names.EXPECTED_V1
    snapshot = VllmSnapshot(
        engines=engines,
        cache_configs=acc.cache_configs,
        schema=schema,
        prefix=prefix,
        deprecated=tuple(sorted(seen & names.DEPRECATED)),
        missing=tuple(m for m in expected if m not in present),
    )
    memory.last = _Last(snapshot, raw, acc.taken, acc.chosen, block_counted)
    return snapshot


class _Last(NamedTuple):
    """A poll that parsed, for the next one's `_patch`."""

    snapshot: VllmSnapshot
    raw: dict[EngineKey, dict[str, float]]  # each engine's counters as read, before `_counted`
    taken: dict[tuple, Series | str]  # _Accumulator.taken
    chosen: dict[str, str]
    block_counted: set[str]


def _patch(found: list[tuple[str, str]], memory: Memory, last: _Last) -> VllmSnapshot | None:
    """The last snapshot with the new values of the runs that moved (every other byte of the body
    is the last one's: RunFinder.moved), when each of their lines is one seen before, the one line
    a counter or gauge of its engine was taken from, and its new value one `take` accepts; else
    None (a full parse). The full parse would read the same lines and take the same samples, these
    with their new values, and finish each engine the same way, so it gives the same snapshot."""
    heads, known, taken = memory.heads, memory.values, last.taken
    runs: dict[str, Run] = {}
    moved: dict[EngineKey, list[tuple[Series, float]]] = {}
    for i, before in memory.finder.moved.items():  # type: ignore[union-attr]
        text, written = found[i]
        run = memory.runs.get(written)
        if run is None and (_NORMAL.get(written) or _normal(written)) not in _READ:
            continue  # a deprecated name the exporter only counts
        if run is None or run.text != before or written in runs or len(run.samples) != run.lines:
            return None
        lines = text[1:].split("\n")
        if len(lines) != run.lines:
            return None
        samples = []
        for line, (series, _) in zip(lines, run.samples, strict=True):
            head, _, tail = line.rpartition(" ")
            if heads.get(head) is not series or taken.get(series.hkey) is not series:
                return None
            value = known.get(tail)
            if value is None:
                if "\t" in tail:
                    return None
                try:
                    value = known[tail] = textformat.parse_value(tail)
                except ValueError:
                    return None
            if not (_usable(series.logical, value) if series.kind == "gauge" else 0 <= value < math.inf):
                return None
            samples.append((series, value))
            moved.setdefault(series.key, []).append((series, value))
        runs[written] = Run(text, len(lines), samples)
    old = last.snapshot
    if not moved.keys() <= old.engines.keys():
        return None
    raw, engines = last.raw, {}  # the last one's raw counters are this one's: `last` is done with
    for key, sample in old.engines.items():
        histograms = dict(sample.histograms)
        if key not in moved:
            engines[key] = EngineSample(
                dict(sample.counters), dict(sample.gauges), histograms, sample.start_time
            )
            continue
        counters, gauges = dict(raw[key]), dict(sample.gauges)
        for series, value in moved[key]:
            if series.kind == "counter":
                counters[series.logical] = 0.0 + value  # as `take` sums it
            else:
                gauges[series.logical] = _gauge(series.logical, [value])
        raw[key] = dict(counters)
        _counted(counters, key[1], last.chosen, last.block_counted, old.cache_configs)
        _finite(key[1], *counters.values(), *gauges.values())
        engines[key] = EngineSample(counters, gauges, histograms, sample.start_time)
    snapshot = VllmSnapshot(
        engines, dict(old.cache_configs), old.schema, old.prefix, old.deprecated, old.missing, old.engine_kind
    )
    memory.runs.update(runs)
    memory.last = _Last(snapshot, raw, taken, last.chosen, last.block_counted)
    return snapshot


def _read_run(text: str, memory: Memory, budget: int, acc: _Accumulator) -> Run:
    """Each line of a run not seen as a whole before, taken in order, at most `budget` of them (the
    caller raises past it); Memory.read's two commonest cases inline: a head and a value seen before."""
    heads, values, limits = memory.heads, memory.values, acc.limits
    samples: list[tuple[Series, float]] = []
    lines = text[1:].split("\n")
    for line in lines[:budget] if len(lines) > budget else lines:
        head, space, tail = line.rpartition(" ")
        series = heads.get(head) if space else None
        value = values.get(tail) if type(series) is Series else None
        if value is None:
            series, value = memory.read(line, limits)
        if type(series) is not str and series.kind is not None:
            acc.take(series, value)
            samples.append((series, value))
    return Run(text, len(lines), samples)


def _finish(
    acc: _Accumulator, block_counted: set[str], memory: Memory
) -> tuple[dict[EngineKey, EngineSample], dict[EngineKey, dict[str, float]]]:
    """The engines with something to say, and every engine's counters as read (for `_patch`)."""
    layouts, last = memory.bounds, memory.histograms
    for (key, logical), parts in acc.gauge_parts.items():
        acc.engines[key].gauges[logical] = _gauge(logical, parts)
    for hkey, buckets in acc.buckets.items():
        bounds, counts = acc.borrowed.get(hkey) or (tuple(sorted(buckets)), None)
        if bounds and math.isinf(bounds[-1]):
            counts = counts or tuple(map(buckets.__getitem__, bounds))
            prior = last.get(hkey)
            if prior is not None and prior.bounds == bounds:  # cheaper than hashing 20-odd floats
                bounds = prior.bounds
            else:
                bounds = layouts.setdefault(bounds, bounds)  # histories then hold one tuple per layout
            histogram = Histogram(bounds, counts, acc.sums.get(hkey, 0.0))
            if histogram != prior:
                _finite(hkey[1], max(counts), histogram.sum)
                last[hkey] = histogram
            # An unchanged histogram is the last poll's object: the history sees `is` and skips it.
            acc.engines[hkey[0]].histograms[hkey[1]] = last[hkey]
    raw = {}
    for key, sample in acc.engines.items():
        if sample.start_time is None:
            sample.start_time = acc.process_start
        raw[key] = dict(sample.counters)
        _counted(sample.counters, key[1], acc.chosen, block_counted, acc.cache_configs)
        _finite(key[1], *sample.counters.values(), *sample.gauges.values())
    return {key: s for key, s in acc.engines.items() if s.counters or s.gauges or s.histograms}, raw


def _counted(
    counters: dict[str, float],
    engine: str,
    chosen: dict[str, str],
    block_counted: set[str],
    cache_configs: dict[str, dict[str, str]],
) -> None:
    """An engine's counters as read -> as exported: prompt tokens split, block counts in tokens."""
    _split_prompt_tokens(counters)
    for logical in ("query_tokens", "hit_tokens"):
        if chosen.get(logical) in block_counted and logical in counters:
            block_size = _block_size(cache_configs.get(engine))
            if block_size is None:
                del counters[logical]  # blocks we cannot convert: better absent than wrong
            else:
                counters[logical] *= block_size


def _finite(what: str, *numbers: float) -> None:
    """Series of one engine (or buckets of one histogram) are summed, and block counts scaled: each
    value finite, the result can still overflow (two counters at 1e308). Such a poll is discarded."""
    if not all(map(math.isfinite, numbers)):
        raise SourceError("parse_error", f"malformed exposition: {what} sums past the largest float")


def _split_prompt_tokens(counters: dict[str, float]) -> None:
    """Prompt tokens computed (prefilled) vs cached; vLLM's by-source counter when it exists."""
    prompt = counters.get("prompt_tokens")
    if prompt is None:
        return
    if "computed_prompt_tokens" not in counters:
        if "hit_tokens" not in counters:
            return
        counters["computed_prompt_tokens"] = max(prompt - counters["hit_tokens"], 0.0)
    counters["cached_prompt_tokens"] = max(prompt - counters["computed_prompt_tokens"], 0.0)


def _block_size(config: dict[str, str] | None) -> int | None:
    try:
        return int((config or {})["block_size"])
    except (KeyError, ValueError):
        return None
