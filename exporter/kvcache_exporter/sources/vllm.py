"""The vLLM source: poll one server's /metrics and normalize it into a VllmSnapshot.

Every naming generation (V1, deprecated V1, V0, `ray_vllm:`) maps onto the same logical
quantities per (model_name, engine); see vllm_names.py.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import aiohttp

from . import textformat
from . import vllm_names as names
from .base import SourceError
from .http import fetch_text, new_session


@dataclass(frozen=True)
class Histogram:
    bounds: tuple[float, ...]  # upper bounds, ascending, ending with +Inf
    counts: tuple[float, ...]  # cumulative counts per bound
    sum: float

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0


@dataclass
class EngineSample:
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    start_time: float | None = None  # changes when vLLM restarts


EngineKey = tuple[str, str]  # (model_name, engine)


@dataclass
class VllmSnapshot:
    ts: float
    engines: dict[EngineKey, EngineSample]
    cache_configs: dict[str, dict[str, str]]  # engine -> cache_config_info labels
    schema: str
    prefix: str
    deprecated: tuple[str, ...]
    missing: tuple[str, ...]

    def model_of(self, engine: str) -> str:
        """cache_config_info has no model_name: join it from the engine's other series."""
        models = sorted({model for model, eng in self.engines if eng == engine})
        return models[0] if models else ""


@dataclass(frozen=True)
class Limits:
    max_samples: int = 200_000
    max_labels: int = 128
    max_engines: int = 512
    max_line_chars: int = 16 * 1024  # vLLM's longest line (cache_config_info) is ~1.1 KiB


class Memory:
    """What one source remembers between polls, since vLLM serves the same series every time:
    each sample line's head (the text before its last space) -> its normalized name and whether
    the exporter reads it, and a textformat.Reader holding the parsed labels of the lines read.
    Both forget everything past `max_entries` heads; one Memory per source (polls never overlap)."""

    def __init__(self, max_entries: int = 50_000):
        self.max_entries = max_entries
        self.prefix = ""
        self.names: dict[str, tuple[str, bool]] = {}
        self.reader = textformat.Reader(max_entries)

    def name_of(self, line: str, prefix: str) -> tuple[str, bool]:
        head, space, _ = line.rpartition(" ")
        known = self.names.get(head) if space else None
        if known is None:
            name = _normal(
                (head if space else line).split("{", 1)[0].split(" ", 1)[0].split("\t", 1)[0], prefix
            )
            known = (name, _base(name) in _WANTED_BASES)
            if space:
                if len(self.names) >= self.max_entries:
                    self.names.clear()
                self.names[head] = known
        return known


class _Accumulator:
    """Collects the wanted samples of one scrape, keyed by (model_name, engine)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.engines: dict[EngineKey, EngineSample] = {}
        self.gauge_parts: dict[tuple[EngineKey, str], list[float]] = defaultdict(list)
        self.buckets: dict[tuple[EngineKey, str], dict[float, float]] = defaultdict(
            lambda: defaultdict(float)
        )
        self.sums: dict[tuple[EngineKey, str], float] = defaultdict(float)
        self.cache_configs: dict[str, dict[str, str]] = {}
        self.process_start: float | None = None

    def engine(self, labels: dict[str, str]) -> EngineSample:
        key = (labels.get("model_name", ""), labels.get("engine", "0"))
        if key not in self.engines:
            if len(self.engines) >= self.limits.max_engines:
                raise SourceError(
                    "too_many_series", f"more than {self.limits.max_engines} (model, engine) pairs"
                )
            self.engines[key] = EngineSample()
        return self.engines[key]


def _normal(name: str, prefix: str) -> str:
    return "vllm:" + name[len(prefix) :] if prefix == "ray_vllm:" and name.startswith(prefix) else name


def _base(name: str) -> str:
    for suffix in ("_total", "_created", "_bucket", "_count", "_sum", "_info"):
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
    for n in (
        *_COUNTER_OF,
        *_GAUGE_OF,
        *_HIST_OF,
        names.PROMPT_BY_SOURCE,
        names.CACHE_CONFIG,
        names.CREATED,
        names.PROCESS_START,
    )
}


def parse(
    text: str, ts: float | None = None, limits: Limits = Limits(), memory: Memory | None = None
) -> VllmSnapshot:
    """Normalize one /metrics exposition. Raises SourceError("parse_error") on malformed text.
    A source passes its Memory so that lines seen in earlier polls cost only their value."""
    acc = _Accumulator(limits)
    chosen: dict[str, str] = {}  # logical -> the candidate name in use
    prefix = "ray_vllm:" if "ray_vllm:" in text else "vllm:"
    memory = memory or Memory()
    if memory.prefix != prefix:  # names are normalized per prefix
        memory.names.clear()
        memory.prefix = prefix
    kept, seen, block_counted = _prefilter(text, prefix, limits, memory)
    try:
        for line in kept:
            name, labels, value = memory.reader.parse_line(line)
            if len(labels) > limits.max_labels:
                raise SourceError("too_many_labels", f"{name} has {len(labels)} labels")
            _take(acc, _normal(name, prefix), labels, value, chosen)
    except ValueError as err:
        raise SourceError("parse_error", f"malformed exposition: {err}") from err
    schema = names.schema_of(seen)
    if schema == "unknown":
        raise SourceError(
            "no_vllm_metrics", "the body holds no vllm: metrics; is --vllm.url a vLLM /metrics?"
        )
    engines = _finish(acc, chosen, block_counted)
    present = set(chosen) | {k for e in engines.values() for k in e.histograms}
    if acc.cache_configs:
        present.add("cache_config")
    expected = names.EXPECTED_V0 if schema == "v0" else names.EXPECTED_V1
    return VllmSnapshot(
        ts=time.time() if ts is None else ts,
        engines=engines,
        cache_configs=acc.cache_configs,
        schema=schema,
        prefix=prefix,
        deprecated=tuple(sorted(seen & names.DEPRECATED)),
        missing=tuple(m for m in expected if m not in present),
    )


def _prefilter(
    text: str, prefix: str, limits: Limits, memory: Memory
) -> tuple[list[str], set[str], set[str]]:
    """The sample lines of the families the exporter reads, every sample name seen, and the
    early-V1 prefix-cache counters whose HELP says they count blocks, not tokens.

    vLLM serves ~45 families and ~700 lines of which about a fifth are read: the others are
    only named (for the schema, deprecation and missing-metric checks), never parsed.
    """
    kept, seen, block_counted = [], set(), set()
    for line in text.split("\n"):
        if not line:
            continue
        if line[0] == "#":
            if "blocks" in line and line.startswith("# HELP "):
                name = _normal(line.split(" ", 3)[2], prefix)
                if name in _BLOCK_COUNTABLE:
                    block_counted.add(name)
            continue
        name, wanted = memory.name_of(line, prefix)
        seen.add(name)
        if wanted:
            if len(line) > limits.max_line_chars:  # bounds the regex work (and the GIL) per line
                raise SourceError(
                    "parse_error", f"a {name} line is longer than {limits.max_line_chars} chars"
                )
            kept.append(line)
            if len(kept) > limits.max_samples:
                raise SourceError("too_many_series", f"more than {limits.max_samples} samples")
    return kept, seen, block_counted


def _take(acc: _Accumulator, name: str, labels: dict[str, str], value: float, chosen: dict[str, str]) -> None:
    """Add one sample. ValueError (-> parse_error) where a count, a time or a bound is impossible:
    windows over a NaN, infinite or negative counter would be wrong for as long as they hold it."""
    if name in _COUNTER_OF:
        logical = _COUNTER_OF[name]
        if chosen.setdefault(logical, name) == name:
            sample = acc.engine(labels)
            sample.counters[logical] = sample.counters.get(logical, 0.0) + _count(name, value)
    elif name == names.PROMPT_BY_SOURCE and labels.get("source") == names.COMPUTED_SOURCE:
        sample = acc.engine(labels)
        value = _count(name, value)
        sample.counters["computed_prompt_tokens"] = sample.counters.get("computed_prompt_tokens", 0.0) + value
    elif name in _GAUGE_OF:
        logical = _GAUGE_OF[name]
        # A gauge that is no number, or a negative count, is dropped: it then reads as missing.
        # (V0's hit-rate gauge says -1 for "no data"; derive/cache.py drops that at export.)
        usable = math.isfinite(value) and (value >= 0 or logical == "v0_block_hit_rate")
        if usable and chosen.setdefault(logical, name) == name:
            acc.engine(labels)
            acc.gauge_parts[((labels.get("model_name", ""), labels.get("engine", "0")), logical)].append(
                value
            )
    elif name in _HIST_OF:
        key = ((labels.get("model_name", ""), labels.get("engine", "0")), _HIST_OF[name])
        acc.engine(labels)
        if name.endswith("_bucket"):
            acc.buckets[key][_bound(name, labels)] += _count(name, value)
        else:
            acc.sums[key] += _count(name, value)
    elif name == names.CACHE_CONFIG:
        acc.cache_configs[labels.get("engine", "0")] = _config(labels)
    elif name == names.CREATED and math.isfinite(value):
        acc.engine(labels).start_time = value
    elif name == names.PROCESS_START and math.isfinite(value):
        acc.process_start = value


def _count(name: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} is {value}: a count is a finite number >= 0")
    return value


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


def _finish(
    acc: _Accumulator, chosen: dict[str, str], block_counted: set[str]
) -> dict[EngineKey, EngineSample]:
    for (key, logical), parts in acc.gauge_parts.items():
        total = sum(parts)
        acc.engines[key].gauges[logical] = total / len(parts) if logical in names.RATIO_GAUGES else total
    for (key, logical), buckets in acc.buckets.items():
        bounds = tuple(sorted(buckets))
        if bounds and math.isinf(bounds[-1]):
            acc.engines[key].histograms[logical] = Histogram(
                bounds, tuple(buckets[b] for b in bounds), acc.sums.get((key, logical), 0.0)
            )
    for (_, engine), sample in acc.engines.items():
        if sample.start_time is None:
            sample.start_time = acc.process_start
        _split_prompt_tokens(sample.counters)
        for logical in ("query_tokens", "hit_tokens"):
            if chosen.get(logical) in block_counted and logical in sample.counters:
                block_size = _block_size(acc.cache_configs.get(engine))
                if block_size is None:
                    del sample.counters[logical]  # blocks we cannot convert: better absent than wrong
                else:
                    sample.counters[logical] *= block_size
    return {key: s for key, s in acc.engines.items() if s.counters or s.gauges or s.histograms}


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


@dataclass
class VllmSource:
    """Polls one vLLM server. The URL comes from configuration only, never from a request."""

    name: ClassVar[str] = "vllm"
    url: str
    timeout: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    bearer_token_file: str | None = None
    limits: Limits = field(default_factory=Limits)
    _session: aiohttp.ClientSession | None = None
    _memory: Memory = field(default_factory=Memory)

    def _headers(self) -> dict[str, str]:
        if not self.bearer_token_file:
            return {}
        try:
            # Re-read every poll so a rotated token (Kubernetes projected secret) is picked up.
            token = Path(self.bearer_token_file).read_text().strip()
        except OSError as err:
            raise SourceError("bearer_token", f"cannot read bearer token file: {err}") from err
        return {"Authorization": f"Bearer {token}"}

    async def collect(self) -> VllmSnapshot:
        if self._session is None:
            self._session = new_session()
        text = await fetch_text(
            self._session,
            self.url,
            timeout=self.timeout,
            max_bytes=self.max_body_bytes,
            headers=self._headers(),
        )
        # In a worker thread: a long parse (8 MiB of series) must not hold up scrapes of /metrics.
        return await asyncio.to_thread(parse, text, None, self.limits, self._memory)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
