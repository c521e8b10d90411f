"""histogram_quantile with PromQL's interpolation, on plain cumulative bucket counts."""

from __future__ import annotations

import math
from collections.abc import Sequence


def histogram_quantile(q: float, bounds: Sequence[float], counts: Sequence[float]) -> float | None:
    """The q-quantile of a cumulative histogram, as PromQL's histogram_quantile computes it.

    `bounds` are ascending upper bounds ending with +Inf, `counts` the cumulative counts.
    Returns None where PromQL would return no value or NaN (no observations, no +Inf bucket,
    a count that is NaN or infinite).
    """
    if not 0 <= q <= 1 or len(bounds) < 2 or len(bounds) != len(counts) or not math.isinf(bounds[-1]):
        return None
    if not all(math.isfinite(c) for c in counts):
        return None  # no quantile of a count that is no number (the parser rejects them; stay pure)
    cumulative = _monotonic(counts)
    total = cumulative[-1]
    if not 0 < total < math.inf:
        return None
    rank = q * total
    b = next((i for i, c in enumerate(cumulative) if c >= rank), len(cumulative) - 1)
    if b == len(bounds) - 1:
        return bounds[-2]
    if b == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if b == 0 else bounds[b - 1]
    before = 0.0 if b == 0 else cumulative[b - 1]
    in_bucket = cumulative[b] - before
    if in_bucket <= 0:
        return start
    return start + (bounds[b] - start) * (rank - before) / in_bucket


def _monotonic(counts: Sequence[float]) -> list[float]:
    """PromQL repairs buckets that decrease (scrape races) by carrying the running maximum."""
    out, peak = [], 0.0
    for c in counts:
        peak = max(peak, c)
        out.append(peak)
    return out
