"""`analyze --html FILE`: one self-contained page (inline SVG, no script, no network) of the report."""

from __future__ import annotations

import html
import math
from collections import defaultdict
from collections.abc import Sequence

from .blocktrace import BlockRequest
from .mrc import Curve, restart_points, route_blocks

# One colour per plot, so a screenshot shows which plots were drawn (tests/analyzer/test_html.py).
COLORS = {
    "time": "#1f77b4",
    "curve": "#d62728",
    "causes": "#2ca02c",
    "prefixes": "#9467bd",
    "replicas": "#ff7f0e",
    "sessions": "#8c564b",
}
W, H, PAD = 640, 240, 44


def _frame(title: str, body: str, x_label: str, y_label: str) -> str:
    return (
        f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="{W}" height="{H}" '
        f'viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg">'
        f'<rect x="{PAD}" y="10" width="{W - PAD - 10}" height="{H - PAD - 10}" fill="none" stroke="#999"/>'
        f'<text x="{W // 2}" y="{H - 8}" text-anchor="middle">{html.escape(x_label)}</text>'
        f'<text x="12" y="{H // 2}" transform="rotate(-90 12 {H // 2})" text-anchor="middle">'
        f"{html.escape(y_label)}</text>{body}</svg></figure>"
    )


def _xy(fx: float, fy: float) -> tuple[float, float]:
    """Fractions of the plot area (0..1, y up) to SVG coordinates."""
    return PAD + fx * (W - PAD - 10), 10 + (1 - fy) * (H - PAD - 10)


def _polyline(points: Sequence[tuple[float, float]], color: str) -> str:
    coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (_xy(fx, fy) for fx, fy in points))
    return f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="3"/>'


def _y_ticks() -> str:
    out = []
    for v in (0, 0.5, 1):
        x, y = _xy(0, v)
        out.append(f'<text x="{x - 4}" y="{y + 4}" text-anchor="end" font-size="11">{v:g}</text>')
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
    label = f"trace time (s, {hi - lo:.0f} s in all)" if use_time else "request"
    marks = ""
    for n in restarts:
        x, _ = _xy((xs[n] - lo) / ((hi - lo) or 1), 0)
        marks += (
            f'<line x1="{x:.1f}" y1="10" x2="{x:.1f}" y2="{H - PAD}" stroke="#555" stroke-dasharray="4 3"/>'
            f'<text x="{x + 4:.1f}" y="24" font-size="11">restart</text>'
        )
    body = _polyline(points, COLORS["time"]) + marks + _y_ticks()
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
        f'<text x="{_xy(fx(s), 0)[0]:.1f}" y="{H - PAD + 14}" font-size="10" '
        f'text-anchor="{"end" if s == sizes[-1] else "middle"}">{s}</text>'
        for s in sizes[::3]
    )
    body = _polyline(points, COLORS["curve"]) + marker + ticks + _y_ticks()
    return _frame(
        "Miss-ratio curve: hit ratio by pool size", body, "KV blocks per replica (log)", "hit ratio"
    )


def bars(title: str, rows: Sequence[tuple[str, float, str]], color: str) -> str:
    """Horizontal bars: (label, fraction 0..1, value text)."""
    height = 26 + 22 * len(rows)
    out = [f'<figure><figcaption>{html.escape(title)}</figcaption><svg width="{W}" height="{height}">']
    for n, (label, fraction, text) in enumerate(rows):
        y = 10 + 22 * n
        width = max(fraction, 0.0) * (W - 380)
        out.append(
            f'<text x="150" y="{y + 14}" text-anchor="end" font-size="12">{html.escape(label)}</text>'
            f'<rect x="156" y="{y}" width="{width:.1f}" height="18" fill="{color}"/>'
            f'<text x="{160 + width:.1f}" y="{y + 14}" font-size="12">{html.escape(text)}</text>'
        )
    return "".join(out) + "</svg></figure>"


def cause_plot(curve: Curve) -> str:
    misses = curve.misses_by_cause
    total = sum(misses.values()) or 1
    rows = [(cause, t / total, f"{t:,} tokens ({t / total:.1%})") for cause, t in misses.items()]
    return bars("Computed prompt tokens by cause (at this pool)", rows, COLORS["causes"])


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
) -> str:
    """`hits`: each request's hit tokens in the observed replay (an overlapping one), else the curve's."""
    restarts = sorted(restart_points(requests, restart_at))
    hits = curve.per_request_hits if hits is None else hits
    parts = [time_plot(requests, hits, restarts), curve_plot(curve), cause_plot(curve)]
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
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>kvcache-exporter analyze</title><style>"
        "body{font-family:sans-serif;margin:24px;background:#fff;color:#222}figure{margin:16px 0}"
        "figcaption{font-weight:bold;margin-bottom:4px}th{text-align:left;padding-right:16px}"
        "</style></head><body><h1>Prefix-cache analysis</h1>"
        f"<table>{rows}</table>{''.join(parts)}</body></html>\n"
    )
