"""A catalog entry (`Metric`): a leaf, so each source declares its entries beside its code
(sources/*_catalog.py) and catalog.py concatenates them."""

from __future__ import annotations

import math
from dataclasses import dataclass

ME = ("model_name", "engine")
GPU = ("gpu", "uuid", "name")


@dataclass(frozen=True)
class Metric:
    name: str
    # counter | gauge | histogram | summary (windowed quantiles: promtool wants `quantile` only on summaries)
    type: str
    help: str
    labels: tuple[str, ...] = ()
    unit: str = ""
    group: str = "cache"
    source: str = ""  # the vLLM/GPU inputs
    formula: str = ""
    per_target: bool = True  # gets a `target` label when several vLLM targets are polled
    allowed: tuple[float, float] | None = None  # values a sample may take; default from the unit

    @property
    def value_range(self) -> tuple[float, float]:
        """Outside it a sample is a bug or bad input: guard.py drops it. Ratios are 0-1, temperatures
        any finite number, everything else (counts, rates, bytes, seconds, money) non-negative."""
        if self.allowed is not None:
            return self.allowed
        if self.unit == "ratio":
            return (0.0, 1.0)
        return (-math.inf, math.inf) if self.unit == "celsius" else (0.0, math.inf)


_NOT_PER_TARGET = {"gpu", "memory", "cost", "events", "fleet", "attribution"}


def entry(*args, **kwargs) -> Metric:
    metric = Metric(*args, **kwargs)
    if metric.group in _NOT_PER_TARGET and "per_target" not in kwargs:
        metric = Metric(*args, **{**kwargs, "per_target": False})
    return metric
