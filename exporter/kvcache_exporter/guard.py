"""The last check before exposition: a sample outside what its catalog entry allows is dropped.

NaN, ±Inf, a negative count, rate, size or duration, and a ratio outside [0, 1] mean bad input
got through or a derivation has a bug; either way the series is better absent than wrong. Each
drop counts as errors_total{collector="derive", reason="invalid_value"}, logged once per metric.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable

from . import catalog
from .samples import Sample

log = logging.getLogger("kvcache_exporter")


def family_of(name: str) -> catalog.Metric | None:
    """The catalog entry of a sample name; a summary's `_count` and `_sum` (and a histogram's
    `_bucket`) belong to the family."""
    spec = catalog.BY_NAME.get(name)
    if spec is None:
        base, _, suffix = name.rpartition("_")
        spec = catalog.BY_NAME.get(base)
        parts = {"summary": ("count", "sum"), "histogram": ("count", "sum", "bucket")}
        if spec is None or suffix not in parts.get(spec.type, ()):
            return None
    return spec


def problem(sample: Sample) -> str | None:
    """Why the sample must not be exported, or None."""
    spec = family_of(sample.name)
    if spec is None:
        return "unknown_metric"
    low, high = spec.value_range
    value = sample.value
    if not isinstance(value, int | float) or not math.isfinite(value) or not low <= value <= high:
        return "invalid_value"
    return None


class Guard:
    def __init__(self) -> None:
        self.errors: Counter[str] = Counter()
        self._logged: set[str] = set()
        self._ranges: dict[str, tuple[float, float] | None] = {}  # name -> its catalog range

    def filter(self, samples: Iterable[Sample]) -> list[Sample]:
        kept = []
        ranges = self._ranges
        for sample in samples:
            name, _, value = sample
            if name not in ranges:
                spec = family_of(name)
                ranges[name] = None if spec is None else spec.value_range
            allowed = ranges[name]
            # the usual case inline (a float in range); problem() says what else is fine or why not
            if (
                allowed is not None
                and type(value) is float
                and allowed[0] <= value <= allowed[1]
                and math.isfinite(value)
            ):
                kept.append(sample)
                continue
            reason = problem(sample)
            if reason is None:
                kept.append(sample)
                continue
            self.errors[reason] += 1
            if sample.name not in self._logged:
                self._logged.add(sample.name)
                log.warning(
                    "dropped %s %s: %s (logged once per metric)",
                    sample.name,
                    sample.labels,
                    sample.value,
                    extra={"collector": "derive", "reason": reason},
                )
        return kept
