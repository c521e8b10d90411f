"""`analyze --html FILE`: one self-contained page (inline SVG, no script, no network) of the report.

The page leads with the verdict (what is wrong, what to do, what it is worth), then the evidence: plots
drawn at the page's full width with values on both axes."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Sequence

from ..mixin.palette import CAUSE_COLORS
from .blocktrace import BlockRequest
from .mrc import Curve, restart_points, route_blocks

# One colour per plot, so a screenshot shows which plots were drawn (tests/analyzer/test_html.py).
COLORS = {
    "time": "#1f77b4",
    "curve": "#d62728",
    "prefixes": "#9467bd",
    "units": "#17becf",
    "replicas": "#ff7f0e",
    "sessions": "#8c564b",
}
VERDICT_COLOR = "#b03a2e"
"""the verdict's left rule: a screenshot finds the diagnosis by it"""
W, H, PAD = 1200, 300, 56
"""SVG user units: every plot is drawn at the page's full width (width 100%, this aspect)"""


def _frame(title: str, body: str, x_label: str, y_label: str) -> str:
    return (
        f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="100%" '
        f'viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg">'
        f'<rect x="{PAD}" y="10" width="{W - PAD - 10}" height="{H - PAD - 10}" fill="none" stroke="#999"/>'
        f'<text x="{W // 2}" y="{H - 6}" text-anchor="middle" font-size="14">{html.escape(x_label)}</text>'
        f'<text x="14" y="{H // 2}" transform="rotate(-90 14 {H // 2})" text-anchor="middle" font-size="14">'
        f"{html.escape(y_label)}</text>{body}</svg></figure>"
    )


def _xy(fx: float, fy: float) -> tuple[float, float]:
    """Fractions of the plot area (0..1, y up) to SVG coordinates."""
    return PAD + fx * (W - PAD - 10), 10 + (1 - fy) * (H - PAD - 10)


def _polyline(points: Sequence[tuple[float, float]], color: str) -> str:
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (_xy(fx, fy) for fx, fy in points))
    return f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="4"/>'


def _y_ticks() -> str:
    out = []
    for v in (0, 0.25, 0.5, 0.75, 1):
        x, y = _xy(0, v)
        out.append(
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{W - 10}" y2="{y:.1f}" stroke="#eee"/>'
            f'<text x="{x - 4}" y="{y + 4}" text-anchor="end" font-size="13">{v:g}</text>'
        )
    return "".join(out)


def _x_ticks(lo: float, hi: float, count: int = 6) -> str:
    """Values along a linear x axis, `lo` at the left edge, `hi` at the right."""
    out = []
    for k in range(count):
        f = k / (count - 1)
        x, y = _xy(f, 0)
        anchor = "start" if k == 0 else "end" if k == count - 1 else "middle"
        out.append(
            f'<line x1="{x:.1f}" y1="{y:.1f}" x2="{x:.1f}" y2="{y + 5:.1f}" stroke="#999"/>'
            f'<text x="{x:.1f}" y="{y + 19:.1f}" font-size="13" text-anchor="{anchor}">'
            f"{lo + f * (hi - lo):,.0f}</text>"
        )
    return "".join(out)


def time_plot(
    requests: Sequence[BlockRequest], hits_of: Sequence[int], restarts: Sequence[int] = (), buckets: int = 60
) -> str:
    stamps = [r.timestamp for r in requests]
    use_time = all(t is not None for t in stamps) and len(set(stamps)) > 1
    xs = stamps if use_time else list(range(len(requests)))
    lo, hi = min(xs), max(xs)
    hits, tokens = [0] * buckets, [0] * buckets
    for x, r, h in zip(xs, requests, hits_of, strict=True):
        b = min(int((x - lo) / ((hi - lo) or 1) * buckets), buckets - 1)
        hits[b] += h
        tokens[b] += r.prompt_tokens
    points = [((b + 0.5) / buckets, hits[b] / tokens[b]) for b in range(buckets) if tokens[b]]
    label = "trace time (s from the first request)" if use_time else "request (trace order)"
    marks = ""
    for n in restarts:
        x, _ = _xy((xs[n] - lo) / ((hi - lo) or 1), 0)
        marks += (
            f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{H - PAD}" stroke="#555" stroke-dasharray="4 3"/>'
            f'<text x="{x + 4:.1f}" y="24" font-size="11">restart</text>'
        )
    body = _polyline(points, COLORS["time"]) + marks + _y_ticks() + _x_ticks(0, hi - lo if use_time else hi)
    return _frame("Hit ratio over the trace (restarts dashed)", body, label, "hit ratio")


def curve_plot(curve: Curve) -> str:
    sizes = curve.sizes
    lo, hi = math.log(sizes[0]), math.log(sizes[-1])

    def fx(size: int) -> float:
        return (math.log(size) - lo) / ((hi - lo) or 1)

    points = [(fx(s), curve.ratio(h)) for s, h in zip(sizes, curve.hit_tokens, strict=True)]
    x, _ = _xy(fx(curve.num_gpu_blocks), 0)
    marker = (
        f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{H - PAD}" stroke="#555" stroke-dasharray="4 3"/>'
        f'<text x="{x + 4:.1f}" y="24" font-size="11">this pool: {curve.num_gpu_blocks}</text>'
    )
    ticks = "".join(
        f'<text x="{_xy(fx(s), 0)[0]:.1f}" y="{H - PAD + 19}" font-size="13" '
        f'text-anchor="{"end" if s == sizes[-1] else "middle"}">{s}</text>'
        for s in sizes[::3]
    )
    body = _polyline(points, COLORS["curve"]) + marker + ticks + _y_ticks()
    return _frame(
        "Miss-ratio curve: hit ratio by pool size", body, "KV blocks per replica (log)", "hit ratio"
    )


def bars(title: str, rows: Sequence[tuple[str, float, str]], color: str | Sequence[str]) -> str:
    """Horizontal bars: (label, fraction 0..1, value text); one colour, or one per row."""
    colors = [color] * len(rows) if isinstance(color, str) else list(color)
    height = 16 + 30 * len(rows)
    out = [
        f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="100%" '
        f'viewBox="0 0 {W} {height}" xmlns="http://www.w3.org/2000/svg">'
    ]
    for n, (label, fraction, text) in enumerate(rows):
        y = 8 + 30 * n
        width = max(fraction, 0.0) * (W - 560)
        out.append(
            f'<text x="200" y="{y + 18}" text-anchor="end" font-size="15">{html.escape(label)}</text>'
            f'<rect x="208" y="{y}" width="{width:.1f}" height="24" fill="{colors[n]}"/>'
            f'<text x="{214 + width:.1f}" y="{y + 18}" font-size="15">{html.escape(text)}</text>'
        )
    return "".join(out) + "</svg></figure>"


def cause_plot(curve: Curve) -> str:
    misses = curve.misses_by_cause
    total = sum(misses.values()) or 1
    rows = [(cause, t / total, f"{t:,} tokens ({t / total:.1%})") for cause, t in misses.items()]
    colors = [CAUSE_COLORS.get(cause, "#444") for cause in misses]
    return bars("Computed prompt tokens by cause (at this pool)", rows, colors)


def unit_plot(units: Sequence[dict]) -> str:
    """The hit unit's cost: hit ratio with no eviction per unit (hitunit.unit_rows)."""
    rows = [
        (
            f"{u['unit']} tokens",
            u["unbounded_hit_ratio"],
            f"{u['unbounded_hit_ratio']:.3f}"
            + (f", {u['lost_tokens']:,} shared tokens lost" if u["lost_tokens"] else ""),
        )
        for u in units
    ]
    return bars("Hit ratio by hit unit (block size), no eviction", rows, COLORS["units"])


def verdict(diagnoses: Sequence[dict], observed: float, unbounded: float) -> str:
    """What is wrong, what to do, what it is worth: the top diagnosis, then the others as a table."""
    if not diagnoses:
        return (
            '<section id="verdict"><h2>No significant cache loss found</h2>'
            f"<p>hit ratio {observed:.3f}; with an unbounded cache {unbounded:.3f}.</p></section>"
        )
    top = diagnoses[0]
    actions = "".join(f"<li>{html.escape(a)}</li>" for a in top["remedies"])
    rows = "".join(
        f"<tr><td>{html.escape(d['title'])}</td><td>{d['gain']:+.3f}</td>"
        f"<td>{d['after']:.3f}</td><td>{html.escape(d['remedies'][0])}</td></tr>"
        for d in diagnoses
    )
    return (
        '<section id="verdict"><p class="label">What is wrong</p>'
        f'<h2 id="diagnosis">{html.escape(top["title"])}</h2><p class="label">What it is worth</p>'
        f'<p class="worth">hit ratio <b>{top["after"]:.3f}</b> '
        f'instead of {observed:.3f} ({top["gain"]:+.3f})</p><p class="label">What to do</p><ul>{actions}</ul>'
        f'<p class="evidence">{html.escape(top["evidence"])}</p>'
        f'<table class="causes"><tr><th>cause, by worth</th><th>worth</th><th>hit ratio after</th>'
        f"<th>what to do</th></tr>{rows}</table></section>"
    )


def prefix_plot(requests: Sequence[BlockRequest], block_size: int, top: int = 10) -> str:
    """The most shared leading chains (by requests x tokens), and how far requests go down them."""
    users: dict[tuple[int, int], int] = defaultdict(int)
    widest_child: dict[tuple[int, int], int] = defaultdict(int)
    for r in requests:
        depth, parent = 0, None
        for group, width in zip(r.groups, r.widths, strict=True):
            depth += width
            node = (group, depth)
            users[node] += 1
            if parent is not None:
                widest_child[parent] = max(widest_child[parent], users[node])
            parent = node
    # Branch points only: a prefix whose every continuation has fewer requests.
    shared = [
        (count * depth, depth, count)
        for (group, depth), count in users.items()
        if count > 1 and widest_child[(group, depth)] < count
    ]
    shared.sort(reverse=True)
    best = shared[0][0] if shared else 1
    rows = [
        (f"{depth * block_size} tokens", score / best, f"{count} requests, then they diverge")
        for score, depth, count in shared[:top]
    ]
    return bars("Most shared prefixes (requests x length)", rows or [("none", 0, "")], COLORS["prefixes"])


def group_plot(
    title: str, keys: Sequence[str], requests, hits_of: Sequence[int], color: str, top: int = 12
) -> str:
    hits: dict[str, int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    for key, r, h in zip(keys, requests, hits_of, strict=True):
        hits[key] += h
        tokens[key] += r.prompt_tokens
    order = sorted(tokens, key=lambda k: -tokens[k])[:top]
    rows = [(k, hits[k] / tokens[k], f"{hits[k] / tokens[k]:.3f} of {tokens[k]:,} tokens") for k in order]
    return bars(title, rows, color)


def render(
    requests: Sequence[BlockRequest],
    curve: Curve,
    settings: dict,
    summary: Sequence[tuple[str, str]],
    restart_at: Sequence[int] = (),
    hits: Sequence[int] | None = None,
    report: dict | None = None,
) -> str:
    """`hits`: each request's hit tokens in the observed replay (an overlapping one), else the curve's.
    `report`: the analysis (its diagnoses, notes and hit-unit rows lead the page)."""
    report = report or {}
    restarts = sorted(restart_points(requests, restart_at))
    hits = curve.per_request_hits if hits is None else hits
    parts = [cause_plot(curve), time_plot(requests, hits, restarts), curve_plot(curve)]
    if report.get("units"):
        parts.append(unit_plot(report["units"]))
    parts.append(prefix_plot(requests, curve.block_size))
    if settings.get("replicas", 1) > 1:
        replicas = route_blocks(requests, settings["replicas"], settings.get("routing", "round-robin"))
        keys = [f"replica {i}" for i in replicas]
        parts.append(group_plot("Hit ratio per replica", keys, requests, hits, COLORS["replicas"]))
    sessions = [r.session or "(none)" for r in requests]
    if len(set(sessions)) > 1:
        parts.append(
            group_plot("Hit ratio per session (largest)", sessions, requests, hits, COLORS["sessions"])
        )
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary)
    notes = "".join(f"<li>{html.escape(n)}</li>" for n in report.get("notes", ()))
    lead = verdict(
        report.get("diagnoses", ()),
        curve.ratio(curve.observed_hit_tokens),
        curve.ratio(curve.unbounded_hit_tokens),
    )
    if "observed" in report:
        lead = verdict(
            report.get("diagnoses", ()), report["observed"]["hit_ratio"], report["unbounded"]["hit_ratio"]
        )
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcache-exporter analyze</title><style>"
        "body{font-family:sans-serif;margin:24px;background:#fff;color:#222}figure{margin:16px 0}"
        "figcaption{font-weight:bold;margin-bottom:4px}th{text-align:left;padding-right:16px}"
        f"#verdict{{border-left:8px solid {VERDICT_COLOR};padding:4px 16px;margin-bottom:20px}}"
        "#verdict h2{margin:2px 0 10px}"
        ".label{margin:6px 0 0;color:#666;font-size:13px;text-transform:uppercase}"
        ".worth{font-size:20px;margin:2px 0 8px}.evidence{color:#444}"
        "table.causes td,table.causes th{padding:2px 12px 2px 0;text-align:left}"
        "</style></head><body><h1>Prefix-cache analysis</h1>"
        f"{lead}<h2>Evidence</h2><table>{rows}</table><ul class='notes'>{notes}</ul>{''.join(parts)}"
        "</body></html>\n"
    )
