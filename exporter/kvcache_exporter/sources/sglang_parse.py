"""Normalize one SGLang /metrics exposition into the snapshot vLLM's parser makes (pure: text in,
snapshot out), so every derivation written for vLLM reads SGLang's data unchanged.

SGLang 0.5.x serves three label sets (../shared/fixtures/sglang-0.5.23/README.md): the tokenizer's
counters and latency histograms (`model_name, engine_type, is_streaming`, `cache_source`), the
scheduler's gauges (`model_name, engine_type, tp_rank, pp_rank, moe_ep_rank`) and the radix tree's
counters (`cache_type, tp_rank, pp_rank, dp_rank`, no `model_name`). One server serves one model:
everything is read into one engine ("0") of the model the tokenizer names. Tensor/pipeline/expert
ranks other than 0 repeat rank 0's batch and tree, so only rank 0 is read; data-parallel ranks
are summed (averaged for a ratio).

The prefix-cache hit ratio is `cached_tokens_total` summed over `cache_source` (device, host,
storage; or SGLang's single `total` series) over `prompt_tokens_total`: SGLang matches every prompt
token against its radix tree, so the prompt tokens are the queried ones. The `cache_hit_rate`
gauge is the last prefill batch's ratio, not a cumulative one: it is never read. SGLang's start-up
warm-up request is counted in every counter, as SGLang counts it; nothing is discounted.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict

from .. import catalog as c
from . import textformat
from .base import SourceError
from .vllm_parse import ParseBounds
from .vllm_snapshot import EngineSample, Histogram, VllmSnapshot

PREFIX = "sglang:"
ENGINE = "0"

COUNTERS = {
    "sglang:prompt_tokens_total": "prompt_tokens",
    "sglang:generation_tokens_total": "generation_tokens",
    # the radix tree and HiCache (tokens): out of the device pool, back from host, written to host
    "sglang:evicted_tokens_total": "evicted_tokens",
    "sglang:load_back_tokens_total": "load_back_tokens",
    "sglang:hicache_backup_tokens_total": "backup_tokens",
    # HiCache's transfers in bytes, read as vLLM's offload traffic (derive/offload.py)
    "sglang:load_back_bytes_total": "offload_load_bytes",
    "sglang:hicache_backup_bytes_total": "offload_store_bytes",
}
CACHED = "sglang:cached_tokens_total"
CACHE_SOURCES = ("device", "host", "storage")  # exported as our `tier` label, same names
CACHE_TOTAL = "total"  # SGLang without a per-source breakdown: one series
GAUGES = {
    "sglang:token_usage": "kv_usage",
    "sglang:num_running_reqs": "running",
    "sglang:num_queue_reqs": "waiting",
    "sglang:kv_used_tokens": "used_tokens",
    "sglang:max_total_num_tokens": "max_total_num_tokens",
    "sglang:num_pages": "num_pages",
    "sglang:page_size": "page_size",
    "sglang:hicache_host_used_tokens": "host_used_tokens",
    "sglang:hicache_host_total_tokens": "host_total_tokens",
}
RATIO_GAUGES = frozenset({"kv_usage"})
SIZE_GAUGES = frozenset({"page_size"})  # the same on every rank: the largest, never a sum
HISTOGRAMS = {
    "ttft": "sglang:time_to_first_token_seconds",
    "queue": "sglang:queue_time_seconds",
    "e2e": "sglang:e2e_request_latency_seconds",
}
EXPECTED = ("prompt_tokens", "hit_tokens", "kv_usage", "running", "waiting", "generation_tokens", "ttft",
            "cache_config")  # fmt: skip
# What vLLM's pages give and SGLang 0.5.x's do not: these series are absent for an SGLang target (never 0);
# docs/metrics.md lists them (docs.py) and tests/sources/test_sglang.py checks they stay absent.
ABSENT = {
    c.PREEMPTIONS_TOTAL: "SGLang counts retracted requests only as a gauge of the moment",
    c.PREEMPTIONS_PER_SECOND: "as above",
    c.EXTERNAL_PREFIX_CACHE_QUERY_TOKENS_TOTAL: "vLLM's KV-connector counters; SGLang's storage "
    'tier is `prompt_tokens_cached_by_tier_total{tier="storage"}`',
    c.EXTERNAL_PREFIX_CACHE_HIT_TOKENS_TOTAL: "as above",
    c.REQUESTS_WAITING_BY_REASON: "vLLM's waiting reasons; SGLang gives the queue length only",
    c.ADMISSION_REJECTIONS_TOTAL: "vLLM's API-server admission limits",
    c.PREFILL_LATENCY_SECONDS: "SGLang has no per-request prefill-time histogram",
    c.KV_BLOCK_LIFETIME_SECONDS: "vLLM's --kv-cache-metrics histograms",
    c.KV_BLOCK_IDLE_BEFORE_EVICT_SECONDS: "as above",
    c.KV_BLOCK_REUSE_GAP_SECONDS: "as above",
    c.PREFILL_COMPUTED_TOKENS: "vLLM's per-request computed-tokens histogram",
    c.VLLM_V0_PREFIX_CACHE_BLOCK_HIT_RATIO: "vLLM V0 only",
    c.OFFLOAD_BUSY_RATIO: "SGLang counts HiCache bytes, not transfer time",
}
_HIST_OF = {
    f"{base}{suffix}": logical for logical, base in HISTOGRAMS.items() for suffix in ("_bucket", "_sum")
}
_READ = {*COUNTERS, CACHED, *GAUGES, *_HIST_OF}
_RUNS = textformat.family_runs(_READ)
_OTHER_RANKS = ("tp_rank", "pp_rank", "moe_ep_rank")
_BOUNDS = ParseBounds()


def is_sglang(text: str) -> bool:
    """Whether a /metrics body is SGLang's (auto-detection: its `sglang:` families)."""
    return "\nsglang:" in text or text.startswith("sglang:") or "# TYPE sglang:" in text


class _Series:
    """What one sample line means, without its value (remembered by line head between polls)."""

    __slots__ = ("bound", "kind", "logical", "model")

    def __init__(self, name: str, labels: dict[str, str]):
        self.model = sys.intern(labels.get("model_name", ""))
        self.bound = 0.0
        if any(labels.get(rank, "0") != "0" for rank in _OTHER_RANKS):
            self.kind, self.logical = None, None  # a repeat of rank 0
        elif name == CACHED:
            source = labels.get("cache_source", CACHE_TOTAL)
            known = source in CACHE_SOURCES or source == CACHE_TOTAL
            self.kind, self.logical = ("cached", source) if known else (None, None)
        elif name in COUNTERS:
            self.kind, self.logical = "counter", COUNTERS[name]
        elif name in GAUGES:
            self.kind, self.logical = "gauge", GAUGES[name]
        else:
            self.logical = _HIST_OF[name]
            self.kind = "bucket" if name.endswith("_bucket") else "sum"
            if self.kind == "bucket":
                bound = float(labels.get("le", "nan"))
                if math.isnan(bound):
                    raise ValueError(f"{name} has no usable le label")
                self.bound = bound


class Memory:
    """Line heads seen before -> their _Series: a repeated line costs a dict lookup and a float()."""

    def __init__(self, max_entries: int = 50_000, max_body_chars: int = 4 << 20):
        self.max_entries = max_entries
        self.heads: dict[str, _Series] = {}
        # the runs read, found where the last body had them: no regex pass over SGLang's ~110 other
        # families while they are unchanged (textformat.RunFinder; "\0" never starts a line)
        self.finder = textformat.RunFinder((_RUNS, _RUNS), "\0", max_body_chars)
        self.last: VllmSnapshot | None = None  # the last poll's, when it parsed

    def series(self, line: str, limits: ParseBounds) -> tuple[_Series, float]:
        head, space, tail = line.rpartition(" ")
        known = self.heads.get(head) if space else None
        if known is not None and "\t" not in tail:
            return known, textformat.parse_value(tail)
        if len(line) > limits.max_line_chars:
            raise SourceError("parse_error", f"a line is longer than {limits.max_line_chars} chars")
        parsed, head = textformat.parse_line_and_head(line)
        if len(parsed.labels) > limits.max_labels:
            raise SourceError("too_many_labels", f"{parsed.name} has {len(parsed.labels)} labels")
        series = _Series(parsed.name, parsed.labels)
        if head is not None:
            if len(self.heads) >= self.max_entries:
                self.heads.clear()
            self.heads[head] = series
        return series, parsed.value


class _Sums:
    def __init__(self) -> None:
        self.counters: dict[str, float] = defaultdict(float)
        self.cached: dict[str, float] = defaultdict(float)
        self.gauges: dict[str, list[float]] = defaultdict(list)
        self.buckets: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
        self.sums: dict[str, float] = defaultdict(float)
        self.models: set[str] = set()

    def take(self, s: _Series, value: float) -> None:
        kind = s.kind
        if kind is None:
            return
        if s.model:
            self.models.add(s.model)
        if kind == "gauge":
            if math.isfinite(value) and value >= 0:  # else read as missing, as vLLM's
                self.gauges[s.logical].append(value)
            return
        count = _count(s.logical, value)
        if kind == "counter":
            self.counters[s.logical] += count
        elif kind == "cached":
            self.cached[s.logical] += count
        elif kind == "bucket":
            self.buckets[s.logical][s.bound] += count
        else:
            self.sums[s.logical] += count


def _count(what: str, value: float) -> float:
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{what} is {value}: a count is a finite number >= 0")
    return value


def parse(
    text: str, limits: ParseBounds = _BOUNDS, memory: Memory | None = None, *, lead: bool = False
) -> VllmSnapshot:
    """Normalize one SGLang /metrics exposition ("\n" + one with `lead`). Raises SourceError on
    malformed text."""
    memory = memory or Memory()
    body = text if lead else "\n" + text
    found = memory.finder.find(body)[0]
    last, memory.last = memory.last, None
    if last is not None and memory.finder.moved == {}:  # every byte the last parsed body's
        memory.last = last
        return last.copy()
    sums = _Sums()
    read = 0
    try:
        for run, _name in found:
            lines = run[1:].split("\n")
            read += len(lines)
            if read > limits.max_samples:
                raise SourceError("too_many_series", f"more than {limits.max_samples} samples")
            for line in lines:
                sums.take(*memory.series(line, limits))
    except ValueError as err:
        raise SourceError("parse_error", f"malformed exposition: {err}") from err
    if not read and not is_sglang(text):
        raise SourceError(
            "no_sglang_metrics", "the body holds no sglang: metrics; is the URL SGLang's /metrics?"
        )
    if len(sums.models) > limits.max_engines:
        raise SourceError("too_many_series", f"more than {limits.max_engines} models")
    sample = engine_sample(sums)
    config = cache_config(sample.gauges)
    engines = {(min(sums.models, default=""), ENGINE): sample} if sample.counters or sample.gauges else {}
    present = {*sample.counters, *sample.gauges, *sample.histograms} | ({"cache_config"} if config else set())
    memory.last = VllmSnapshot(
        engines=engines,
        cache_configs={ENGINE: config} if config else {},
        schema="sglang",
        prefix=PREFIX,
        deprecated=(),
        missing=tuple(m for m in EXPECTED if m not in present),
        engine_kind="sglang",
    )
    return memory.last


def engine_sample(sums: _Sums) -> EngineSample:
    """SGLang's sums as the logical quantities vLLM's derivations read."""
    counters = dict(sums.counters)
    by_source = {s: sums.cached[s] for s in CACHE_SOURCES if s in sums.cached}
    # a cache_source's series is born with its first hit: none at all is 0 hits, not an unknown count
    # (else a window starting before the first hit would lose that hit's tokens)
    hits = sum(by_source.values()) if by_source else sums.cached.get(CACHE_TOTAL, 0.0)
    counters.update({f"cached_tier_{s}": n for s, n in by_source.items()})
    prompt = counters.get("prompt_tokens")
    if prompt is not None:
        counters["query_tokens"] = prompt
        if hits is not None:
            counters["hit_tokens"] = hits
            counters["cached_prompt_tokens"] = min(hits, prompt)
            counters["computed_prompt_tokens"] = max(prompt - hits, 0.0)
    gauges = {}
    for logical, values in sums.gauges.items():
        total = sum(values)
        if logical in RATIO_GAUGES:
            total /= len(values)
        gauges[logical] = max(values) if logical in SIZE_GAUGES else total
    page = gauges.get("page_size")
    if page and "used_tokens" in gauges:
        gauges["blocks_in_use"] = gauges["used_tokens"] / page
    histograms = {}
    for logical, buckets in sums.buckets.items():
        bounds = tuple(sorted(buckets))
        if bounds and math.isinf(bounds[-1]):
            histograms[logical] = Histogram(
                bounds, tuple(buckets[b] for b in bounds), sums.sums.get(logical, 0.0)
            )
    for number in (*counters.values(), *gauges.values()):
        if not math.isfinite(number):
            raise SourceError("parse_error", "malformed exposition: a sum past the largest float")
    return EngineSample(counters, gauges, histograms)


def cache_config(gauges: dict[str, float]) -> dict[str, str]:
    """SGLang's capacity gauges as the cache_config_info labels the block derivations read."""
    config = {}
    if "page_size" in gauges:
        config["block_size"] = str(int(gauges["page_size"]))
    if "num_pages" in gauges:
        config["num_gpu_blocks"] = str(int(gauges["num_pages"]))
    if "max_total_num_tokens" in gauges:
        config["kv_cache_size_tokens"] = str(int(gauges["max_total_num_tokens"]))
    return config
