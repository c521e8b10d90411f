"""What every source shares: the error it raises and the sample type derivations return."""

from __future__ import annotations

from typing import NamedTuple


class SourceError(Exception):
    """A source could not deliver a snapshot. `reason` becomes the errors counter's label."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


class SourceUnavailable(SourceError):
    """The source cannot exist here (no NVML driver, no GPU): reported at debug level, not as an error."""

    def __init__(self, message: str):
        super().__init__("unavailable", message)


class Sample(NamedTuple):
    """One exported value: a catalog metric name, its labels and the value."""

    name: str
    labels: dict[str, str]
    value: float
