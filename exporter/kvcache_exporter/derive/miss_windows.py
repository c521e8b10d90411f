"""Attribution totals -> samples: counters, the offset histogram, and windows joined with /metrics. Pure.

The classifier (attribution.py) keeps cumulative totals. Each poll's ingest records them in a
history of their own (`MissHistory`), so a window's attributed tokens are measured over the same
seconds as vLLM's `prefix_cache_{queries,hits}` deltas from the targets' poll history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .. import catalog as c
from ..samples import Sample
from ..sources.vllm_snapshot import EngineSample, VllmSnapshot
from .attribution import CAPACITY_FACTORS, OFFSET_BUCKETS, TURN_BUCKETS, Totals
from .cache_config import config_number
from .layouts import LAYOUTS
from .reorder import reordered_hit_ratio
from .whatif import host_hit_ratio
from .windows import Delta, SeriesHistory

VllmWindow = Callable[[float], Delta | None]  # window seconds -> summed deltas of vLLM's counters


class MissHistory:
    """The attribution totals of every poll, for windows (ingest records; derivations only read)."""

    def __init__(self, retention: float):
        self.history = SeriesHistory(retention)

    def record(self, ts: float, totals: Totals) -> None:
        self.history.append(ts, EngineSample(counters=_counters(totals)))

    def window(self, seconds: float) -> Delta | None:
        return self.history.window(seconds)


def miss_samples(
    totals: Totals, misses: MissHistory, windows: Sequence[tuple[float, str]], vllm: VllmWindow
) -> list[Sample]:
    out = totals_samples(totals)
    for seconds, label in windows:
        mine, theirs = misses.window(seconds), vllm(seconds)
        if mine is not None and theirs is not None:
            out += window_samples(label, mine.counters, theirs.counters, mine.seconds)
    return out


def memory_samples(tracked: tuple[int, int], limits: tuple[int, int]) -> list[Sample]:
    """How full the attribution memory is: (blocks, fingerprints) held and their bounds."""
    out = []
    for kind, held, limit in zip(("blocks", "fingerprints"), tracked, limits, strict=True):
        out.append(Sample(c.PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED, {"kind": kind}, held))
        out.append(Sample(c.PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED_LIMIT, {"kind": kind}, limit))
    return out


def num_gpu_blocks(snapshot: VllmSnapshot | None) -> int | None:
    """One engine's block count from cache_config_info (a KV-event stream is one rank's)."""
    configs = snapshot.cache_configs.values() if snapshot is not None else ()
    values = [config_number(config, "num_gpu_blocks") for config in configs]
    return max((int(v) for v in values if v is not None and 0 < v < 1 << 40), default=None)


def _counters(totals: Totals) -> dict[str, float]:
    counters = {"attributed": float(totals.prompt_miss_tokens)}
    counters |= {f"extra_{f}": float(n) for f, n in totals.extra_hit_tokens.items()}
    counters["diverged"] = float(totals.tokens["prefix_diverged"])
    counters |= {f"reorder_{layout}": float(n) for layout, n in totals.reorder_tokens.items()}
    counters["window_expired"] = float(totals.tokens["window_expired"])  # the audit's window_retention
    if totals.host_hit_tokens is not None:
        counters["extra_host"] = float(totals.host_hit_tokens)
        counters["host_load_bytes"] = totals.host_load_bytes
    return counters


def totals_samples(totals: Totals) -> list[Sample]:
    tokens = totals.tokens.items()
    out = [Sample(c.PREFIX_CACHE_MISS_TOKENS_TOTAL, {"cause": cause}, n) for cause, n in tokens]
    out.append(Sample(c.KV_EVENTS_DECODE_TOKENS_TOTAL, {}, totals.decode_tokens))
    for layout, n in totals.reorder_tokens.items():
        out.append(Sample(c.PREFIX_CACHE_REORDER_HIT_TOKENS_TOTAL, {"layout": layout}, n))
    out.append(Sample(c.PREFIX_CACHE_UNORDERED_EVENTS_TOTAL, {}, totals.unordered_events))
    running = 0
    for bound, count in zip((*OFFSET_BUCKETS, float("inf")), totals.offset_counts, strict=True):
        running += count
        le = "+Inf" if bound == float("inf") else str(float(bound))
        out.append(Sample(c.PREFIX_DIVERGENCE_OFFSET_TOKENS + "_bucket", {"le": le}, running))
    out.append(Sample(c.PREFIX_DIVERGENCE_OFFSET_TOKENS + "_sum", {}, totals.offset_sum))
    out.append(Sample(c.PREFIX_DIVERGENCE_OFFSET_TOKENS + "_count", {}, running))
    running = 0
    for bound, count in zip((*TURN_BUCKETS, float("inf")), totals.rewritten_turn_counts, strict=True):
        running += count
        le = "+Inf" if bound == float("inf") else str(float(bound))
        out.append(Sample(c.PREFIX_HISTORY_REWRITTEN_TURN + "_bucket", {"le": le}, running))
    out.append(Sample(c.PREFIX_HISTORY_REWRITTEN_TURN + "_sum", {}, totals.rewritten_turn_sum))
    out.append(Sample(c.PREFIX_HISTORY_REWRITTEN_TURN + "_count", {}, running))
    return out


def window_samples(
    label: str, mine: dict[str, float], vllm: dict[str, float], seconds: float | None = None
) -> list[Sample]:
    """Coverage and the what-if hit ratios of one window; none where vLLM saw nothing to divide by.
    `seconds`: the window's real span (the host tier's load rate).

    Attributed tokens above what vLLM computed are a fault of the stream (a hostile or broken
    publisher, or events running ahead of /metrics): shown as the excess, with coverage and the
    estimates built on the attribution absent for the window, never clipped into a healthy 1.0."""
    queries, hits = vllm.get("query_tokens"), vllm.get("hit_tokens")
    if queries is None or hits is None or queries <= 0:
        return []
    out = []
    computed = queries - hits - vllm.get("external_hit_tokens", 0.0)  # loaded from a tier: not computed
    attributed = mine.get("attributed")
    if attributed is not None:
        excess = max(attributed - max(computed, 0.0), 0.0)
        out.append(Sample(c.PREFIX_CACHE_MISS_ATTRIBUTION_EXCESS_TOKENS, {"window": label}, excess))
        if excess:
            return out
        if computed > 0:
            coverage = max(attributed / computed, 0.0)
            out.append(Sample(c.PREFIX_CACHE_MISS_ATTRIBUTION_COVERAGE_RATIO, {"window": label}, coverage))
    for factor in CAPACITY_FACTORS:
        extra = mine.get(f"extra_{factor}")
        if extra is not None:
            estimate = _ratio(hits + extra, queries)
            labels = {"window": label, "capacity_factor": str(factor)}
            if estimate is not None:
                out.append(Sample(c.PREFIX_CACHE_HIT_RATIO_ESTIMATE, labels, estimate))
    reordered = reordered_hit_ratio(hits, queries, mine["diverged"]) if "diverged" in mine else None
    if reordered is not None:
        out.append(Sample(c.PREFIX_CACHE_HIT_RATIO_REORDERED_ESTIMATE, {"window": label}, reordered))
    for layout in LAYOUTS:
        moved = mine.get(f"reorder_{layout}")
        estimate = None if moved is None else reordered_hit_ratio(hits, queries, moved)
        if estimate is not None:
            labels = {"window": label, "layout": layout}
            out.append(Sample(c.PREFIX_CACHE_HIT_RATIO_REORDERED_LAYOUT_ESTIMATE, labels, estimate))
    host = host_hit_ratio(hits, queries, mine["extra_host"]) if "extra_host" in mine else None
    if host is not None:
        out.append(Sample(c.PREFIX_CACHE_HIT_RATIO_HOST_TIER_ESTIMATE, {"window": label}, host))
        if seconds:
            load = mine["host_load_bytes"] / seconds
            out.append(Sample(c.HOST_TIER_LOAD_BYTES_PER_SECOND_ESTIMATE, {"window": label}, load))
    return out


def _ratio(part: float, whole: float) -> float | None:
    """part / whole, None above 1 (more extra hits than queries: a fault, not a ratio to clip)."""
    ratio = max(part / whole, 0.0)
    return ratio if ratio <= 1.0 else None


def excess_tokens(samples: Sequence[Sample]) -> float:
    """The largest excess of attributed over computed tokens among the windows' samples."""
    name = c.PREFIX_CACHE_MISS_ATTRIBUTION_EXCESS_TOKENS
    return max((s.value for s in samples if s.name == name), default=0.0)


def summed_window(deltas: Sequence[Delta | None]) -> Delta | None:
    """The engines' deltas added up (one KV-event stream covers the engines of one vLLM server)."""
    present = [d for d in deltas if d is not None]
    if not present:
        return None
    counters: dict[str, float] = {}
    for delta in present:
        for name, value in delta.counters.items():
            counters[name] = counters.get(name, 0.0) + value
    return Delta(max(d.seconds for d in present), counters, {})
