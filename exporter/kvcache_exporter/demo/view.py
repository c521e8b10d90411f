"""The demo's live view: read the exporter's own /metrics and render a frame (ANSI) or one line per tick."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from .. import catalog as c

CLEAR = "\x1b[H\x1b[2J"
BOLD, DIM, RESET = "\x1b[1m", "\x1b[2m", "\x1b[0m"
RED, YELLOW, GREEN = "\x1b[31m", "\x1b[33m", "\x1b[32m"


@dataclass
class Snapshot:
    up: float | None = None
    hit_ratio: dict[str, float] = field(default_factory=dict)
    """window label -> hit ratio (mean over engines)"""
    prefill_p99: dict[str, float] = field(default_factory=dict)
    block_utilization: float | None = None
    cost_per_million_tokens: dict[str, float] = field(default_factory=dict)
    """token kind -> cost per million tokens over the shortest window"""
    ttft_p99: dict[str, float] = field(default_factory=dict)
    miss_tokens: dict[str, float] = field(default_factory=dict)
    """cause -> miss tokens since the exporter started (KV events)"""
    offset_sum: float = 0.0
    offset_count: float = 0.0
    estimate_2x: float | None = None
    """the hit ratio with twice the KV cache, over the shortest hit-ratio window (else none)"""
    reordered: float | None = None
    """the hit ratio had the per-request fields come after the shared part (that window too)"""
    currency: str = ""
    """the currency of every cost (kvcache_cost_info's label: the exporter's --cost.currency)"""


PHASE_TEXT = {
    "normalized": "static template first, per-request fields last: prompts share their prefix",
    "raw": "per-request header (user id, timestamp, order no.) first: every prompt differs from token 1",
    "templates": "40 recurring 1,000-token templates, more than the KV cache holds: evicted before reuse",
}
ACTION = {
    "prefix_diverged": "move per-request fields after the static template; keep that part byte-identical",
    "evicted": "the cache is too small for this traffic's working set: more KV memory, fewer sequences,"
    " shorter contexts",
    "restart": "vLLM restarted: the cache is warming up",
    "cold": "new content: nothing to share yet",
    "other_replica": "route requests sharing a prefix to the same replica",
    "history_rewritten": "make the chat template reproduce earlier answers verbatim (reasoning, tool args)",
    "content_moved": "sort tools/documents deterministically; per-request ranking after them",
    "window_expired": "set vLLM's --prefix-cache-retention-interval: window parts are dropped before reuse",
    "below_hit_unit": "make the shared part at least one hit unit long (or pad it to one)",
    "identity_isolated": "another LoRA adapter or cache_salt: isolated by design, nothing to fix",
}


LOW_UTILIZATION = 0.5
TOO_SMALL_AT_LOW_UTILIZATION = (
    "block util counts only blocks running requests hold; what does not fit is the content reused"
    " between requests (the working set), evicted from the free cached blocks before it comes back"
)


@dataclass(frozen=True)
class Misses:
    """Miss attribution between two snapshots: shares by cause, mean divergence offset."""

    shares: dict[str, float]
    offset: float | None

    @property
    def top(self) -> str | None:
        return max(self.shares, key=self.shares.get) if self.shares else None


def recent_misses(before: Snapshot | None, now: Snapshot | None) -> Misses | None:
    if before is None or now is None:
        return None
    delta = {c: now.miss_tokens.get(c, 0.0) - before.miss_tokens.get(c, 0.0) for c in now.miss_tokens}
    total = sum(v for v in delta.values() if v > 0)
    if total <= 0:
        return None
    count = now.offset_count - before.offset_count
    offset = (now.offset_sum - before.offset_sum) / count if count > 0 else None
    return Misses({c: v / total for c, v in sorted(delta.items()) if v > 0}, offset)


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if not math.isnan(v)]
    return sum(values) / len(values) if values else None


def _window_seconds(label: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    total, number = 0.0, ""
    i = 0
    while i < len(label):
        ch = label[i]
        if ch.isdigit() or ch == ".":
            number += ch
            i += 1
            continue
        unit = "ms" if label.startswith("ms", i) else ch
        total += float(number or 0) * units.get(unit, 0)
        number = ""
        i += len(unit)
    return total + (float(number) if number else 0.0)


def parse_metrics(text: str) -> Snapshot:
    hits: dict[str, list[float]] = {}
    p99: dict[str, list[float]] = {}
    ttft: dict[str, list[float]] = {}
    estimates: dict[str, list[float]] = {}
    reordered: dict[str, list[float]] = {}
    util: list[float] = []
    cost: dict[str, dict[str, list[float]]] = {}
    snap = Snapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == c.VLLM_UP:
                snap.up = value if snap.up is None else min(snap.up, value)
            elif name == c.PREFIX_CACHE_HIT_RATIO and "window" in labels:
                hits.setdefault(labels["window"], []).append(value)
            elif name == c.PREFILL_LATENCY_SECONDS and labels.get("quantile") == "0.99":
                p99.setdefault(labels.get("window", ""), []).append(value)
            elif name == c.TIME_TO_FIRST_TOKEN_SECONDS and labels.get("quantile") == "0.99":
                ttft.setdefault(labels.get("window", ""), []).append(value)
            elif name == c.PREFIX_CACHE_MISS_TOKENS_TOTAL and "replica" not in labels:
                snap.miss_tokens[labels["cause"]] = value
            elif name == c.PREFIX_DIVERGENCE_OFFSET_TOKENS + "_sum":
                snap.offset_sum = value
            elif name == c.PREFIX_DIVERGENCE_OFFSET_TOKENS + "_count":
                snap.offset_count = value
            elif name == c.PREFIX_CACHE_HIT_RATIO_ESTIMATE and labels.get("capacity_factor") == "2":
                estimates.setdefault(labels.get("window", ""), []).append(value)
            elif name == c.PREFIX_CACHE_HIT_RATIO_REORDERED_ESTIMATE:
                reordered.setdefault(labels.get("window", ""), []).append(value)
            elif name == c.BLOCK_UTILIZATION_RATIO:
                util.append(value)
            elif name == c.COST_INFO and labels.get("currency"):
                snap.currency = labels["currency"]
            elif name == c.COST_PER_MILLION_TOKENS:
                kinds = cost.setdefault(labels.get("window", ""), {})
                kinds.setdefault(labels.get("token_kind", "all"), []).append(value)
    by_window = lambda d: dict(sorted(d.items(), key=lambda kv: _window_seconds(kv[0])))  # noqa: E731
    snap.hit_ratio = {w: m for w, vs in by_window(hits).items() if (m := _mean(vs)) is not None}
    snap.prefill_p99 = {w: m for w, vs in by_window(p99).items() if (m := _mean(vs)) is not None}
    snap.ttft_p99 = {w: m for w, vs in by_window(ttft).items() if (m := _mean(vs)) is not None}
    now = next(iter(snap.hit_ratio), None)  # the what-ifs of the same window, or none: comparable
    snap.estimate_2x = _mean(estimates.get(now, []))
    snap.reordered = _mean(reordered.get(now, []))
    snap.block_utilization = _mean(util)
    if cost:
        shortest = by_window(cost)
        kinds = shortest[next(iter(shortest))]
        snap.cost_per_million_tokens = {
            k: m for k, vs in sorted(kinds.items()) if (m := _mean(vs)) is not None
        }
    return snap


@dataclass
class Phase:
    name: str
    index: int
    count: int
    elapsed: float
    left: float | None


def _fmt(value: float | None, spec: str = ".3f", suffix: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{suffix}"


def alerts_summary(alerts: list[dict] | None, absent: str | None) -> tuple[list[str], list[str]]:
    """(firing, pending) alert names; `absent` (why Prometheus does not run) alone when it does not."""
    if absent:
        return [absent], []
    if alerts is None:
        return ["Prometheus not answering"], []
    firing = sorted({a.get("labels", {}).get("alertname", "?") for a in alerts if a.get("state") == "firing"})
    pending = sorted(
        {a.get("labels", {}).get("alertname", "?") for a in alerts if a.get("state") == "pending"}
    )
    return firing, pending


def render_line(
    t: float,
    phase: Phase,
    snap: Snapshot | None,
    firing: list[str],
    pending: list[str],
    misses: Misses | None = None,
) -> str:
    parts = [f"[{t:7.1f}s]", f"phase={phase.name} ({phase.index}/{phase.count}, +{phase.elapsed:.1f}s)"]
    if snap is None:
        parts.append("exporter=unreachable")
    else:
        parts += [f"hit_ratio{{{w}}}={v:.3f}" for w, v in snap.hit_ratio.items()] or ["hit_ratio=n/a"]
        parts += [f"prefill_p99{{{w}}}={v:.3f}s" for w, v in list(snap.prefill_p99.items())[:1]]
        parts += [f"ttft_p99{{{w}}}={v:.3f}s" for w, v in list(snap.ttft_p99.items())[:1]]
        if snap.reordered is not None:
            parts.append(f"reordered={snap.reordered:.3f}")
        if misses is not None:
            parts.append(f"top_miss={misses.top}")
            parts += [f"miss{{{cause}}}={share:.2f}" for cause, share in misses.shares.items()]
            if misses.offset is not None:
                parts.append(f"offset={misses.offset:.0f}")
        parts.append(f"block_util={_fmt(snap.block_utilization)}")
        cost = snap.cost_per_million_tokens
        parts += [f"cost_per_Mtok{{{k}}}={v:.4f}" for k, v in cost.items()] or ["cost_per_Mtok=n/a"]
        if cost and snap.currency:
            parts.append(f"currency={snap.currency}")
    parts.append("alerts=" + (",".join(firing) if firing else "none"))
    if pending:
        parts.append("pending=" + ",".join(pending))
    return " ".join(parts)


def _color_ratio(value: float) -> str:
    color = GREEN if value >= 0.6 else YELLOW if value >= 0.3 else RED
    bar = "#" * round(value * 30)
    return f"{color}{value:6.1%}{RESET} {color}{bar:<30}{RESET}"


def render_frame(
    t: float,
    phase: Phase,
    snap: Snapshot | None,
    firing: list[str],
    pending: list[str],
    urls: dict[str, str],
    misses: Misses | None = None,
) -> str:
    left = "" if phase.left is None else f", {phase.left:.0f}s left"
    lines = [
        f"{BOLD}kvcache-exporter demo{RESET}   t={t:.0f}s   (Ctrl-C stops everything)",
        "  " + "   ".join(f"{name}: {url}" for name, url in urls.items()),
        "",
        f"{BOLD}phase{RESET}           {phase.name}  "
        f"({phase.index}/{phase.count}, +{phase.elapsed:.0f}s{left})",
        f"                {DIM}{PHASE_TEXT.get(phase.name, '')}{RESET}",
    ]
    if snap is None:
        lines.append(f"{RED}exporter unreachable{RESET}")
    else:
        if not snap.hit_ratio:
            lines.append(f"{BOLD}hit ratio{RESET}       n/a (waiting for traffic)")
        for w, v in snap.hit_ratio.items():
            lines.append(f"{BOLD}hit ratio{RESET} {w:>5} {_color_ratio(v)}")
        for w, v in snap.prefill_p99.items():
            ttft = snap.ttft_p99.get(w)
            ttft_text = "" if ttft is None else f"   TTFT p99 {ttft * 1000:8.1f} ms"
            lines.append(f"{BOLD}prefill p99{RESET} {w:>3} {v * 1000:8.1f} ms{ttft_text}")
        lines += _miss_lines(misses, snap)
        lines.append(f"{BOLD}block util{RESET}      {_fmt(snap.block_utilization, '.1%')}")
        cost = "   ".join(f"{k} {v:.4f}" for k, v in snap.cost_per_million_tokens.items()) or "n/a"
        currency = f"{snap.currency}  " if snap.cost_per_million_tokens and snap.currency else ""
        lines.append(f"{BOLD}cost / 1M tok{RESET}   {currency}{cost}")
    if firing and firing[0].startswith("Prometheus "):
        lines.append(f"{BOLD}alerts{RESET}          {DIM}{firing[0]}{RESET}")
    else:
        shown = f"{RED}{', '.join(firing)}{RESET}" if firing else f"{GREEN}none firing{RESET}"
        lines.append(f"{BOLD}alerts{RESET}          {shown}")
        if pending:
            lines.append(f"{BOLD}pending{RESET}         {YELLOW}{', '.join(pending)}{RESET}")
    return CLEAR + "\n".join(lines) + "\n"


def why(misses: Misses | None) -> str | None:
    """The top cause of the recent misses, its share, and what the stream says about it."""
    if misses is None or misses.top is None:
        return None
    text = f"{misses.top} ({misses.shares[misses.top]:.0%} of the recent misses)"
    if misses.top == "prefix_diverged" and misses.offset is not None:
        text += f": shared content starts ~{misses.offset:.0f} tokens into the prompt"
    return text


def worth(misses: Misses | None, snap: Snapshot | None) -> str | None:
    """What the action is worth, from the exporter's what-if estimates (shortest window)."""
    if misses is None or snap is None or not snap.hit_ratio:
        return None
    now = next(iter(snap.hit_ratio.values()))
    if misses.top == "prefix_diverged" and snap.reordered is not None:
        return (
            f"moving the per-request fields after the shared part: ~{snap.reordered:.0%} instead of {now:.0%}"
        )
    if misses.top == "evicted" and snap.estimate_2x is not None:
        return f"twice the KV cache: ~{snap.estimate_2x:.0%} instead of {now:.0%}"
    return None


def too_small_note(misses: Misses | None, snap: Snapshot | None) -> str | None:
    """Why "too small" stands beside a low block utilization: both are true."""
    if misses is None or misses.top != "evicted" or snap is None or snap.block_utilization is None:
        return None
    return TOO_SMALL_AT_LOW_UTILIZATION if snap.block_utilization < LOW_UTILIZATION else None


# Line mode tells a cause once its figures stopped moving: the same top cause over the last ticks,
# and its share, the hit ratio now and the offset (in 50-token units) each within SETTLE_SPREAD.
# (The what-if estimate is left out: over a short window it wanders by 0.1-0.2 between polls.)
SETTLE_TICKS, SETTLE_SPREAD = 3, 0.05


def _figures(misses: Misses, snap: Snapshot | None) -> tuple[float, ...]:
    now = next(iter(snap.hit_ratio.values()), None) if snap is not None else None
    offset = (misses.offset or 0.0) / 50 if misses.top == "prefix_diverged" else 0.0
    return (misses.shares[misses.top], -1.0 if now is None else now, offset)


@dataclass
class Narrator:
    """Line mode's story: one line when a phase starts; why, action and worth once the cause has
    settled (the short window holds this phase's traffic only, and the top cause and its figures
    held still for SETTLE_TICKS ticks), again when the settled cause changes, and the worth when it
    becomes known later. The worth is the latest this phase's short window gave for the same cause: the
    exporter leaves a window's what-ifs out while its KV events run ahead of vLLM's counters, which a
    3 s window on a busy machine often is."""

    window: float
    """the short window's seconds: before it has passed, the misses mix in the last phase's"""
    phase: int = 0
    told: tuple[str, bool] | None = None
    recent: list[tuple[str, tuple[float, ...]]] = field(default_factory=list)
    known_worth: tuple[str, str] | None = None
    """(cause, worth) last given in this phase"""

    def tell(self, phase: Phase, misses: Misses | None, snap: Snapshot | None) -> list[str]:
        out = []
        if phase.index != self.phase:
            self.phase, self.told, self.recent, self.known_worth = phase.index, None, [], None
            out.append(
                f"demo: phase {phase.index}/{phase.count} {phase.name}: {PHASE_TEXT.get(phase.name, '')}"
            )
        if misses is None or misses.top is None or phase.elapsed < self.window:
            self.recent = []
            return out
        self.recent = [*self.recent, (misses.top, _figures(misses, snap))][-SETTLE_TICKS:]
        value = worth(misses, snap)
        if value is not None:
            self.known_worth = (misses.top, value)
        elif self.known_worth is not None and self.known_worth[0] == misses.top:
            value = self.known_worth[1]
        causes = {cause for cause, _ in self.recent}
        spreads = [max(f) - min(f) for f in zip(*(figures for _, figures in self.recent), strict=True)]
        if len(self.recent) < SETTLE_TICKS or len(causes) > 1 or max(spreads) > SETTLE_SPREAD:
            return out
        if self.told == (misses.top, value is not None):
            return out
        if self.told is None or self.told[0] != misses.top:
            out += [f"demo: why: {why(misses)}", f"demo: action: {ACTION.get(misses.top, '')}"]
            note = too_small_note(misses, snap)
            out += [f"demo: note: {note}"] if note else []
        out += [f"demo: worth: {value}"] if value is not None else []
        self.told = (misses.top, value is not None)
        return out


def _miss_lines(misses: Misses | None, snap: Snapshot) -> list[str]:
    """Why the cache misses now (KV events), what to do about it, and what that is worth."""
    if misses is None or misses.top is None:
        return [f"{BOLD}misses{RESET}          {DIM}n/a (no computed blocks lately){RESET}"]
    shares = "  ".join(f"{cause} {share:.0%}" for cause, share in misses.shares.items())
    lines = [f"{BOLD}misses{RESET}          {shares}"]
    lines += [
        f"{BOLD}why{RESET}             {YELLOW}{why(misses)}{RESET}",
        f"{BOLD}action{RESET}          {ACTION.get(misses.top, '')}",
    ]
    value = worth(misses, snap)
    if value is not None:
        lines.append(f"{BOLD}worth{RESET}           {GREEN}{value}{RESET}")
    note = too_small_note(misses, snap)
    if note is not None:
        lines.append(f"{BOLD}note{RESET}            {DIM}{note}{RESET}")
    return lines
