"""The one value type derivations return and exposition renders: neutral ground for both."""

from __future__ import annotations

from typing import NamedTuple


class Sample(NamedTuple):
    """One exported value: a catalog metric name, its labels and the value."""

    name: str
    labels: dict[str, str]
    value: float
