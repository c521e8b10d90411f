"""Durations, one grammar for every flag, YAML key and config file we read, and one way to write them.

The grammar is Prometheus's: one or more `<number><unit>` with units ms, s, m, h, d, w, largest
first (`90s`, `1m30s`, `1h`, `500ms`; a decimal such as `1.5s` is accepted too). A bare number is
refused wherever it comes from (`5` could mean seconds or minutes): a flag and a YAML value agree.
Derivations import `window_label` from here: this module imports nothing of the package.
"""

from __future__ import annotations

import re

UNITS = {"w": 604_800, "d": 86_400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w)")
_ORDER = list(UNITS)
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def parse_duration(text: object) -> float:
    """`1m30s` -> 90.0 seconds; ValueError for anything else, a bare number or a zero included."""
    if isinstance(text, bool) or not isinstance(text, str | int | float):
        raise ValueError(f"{text!r} is not a duration (use e.g. 5s, 1m, 1h30m)")
    if isinstance(text, int | float) or _NUMBER.fullmatch(text):
        raise ValueError(f'{text} needs a unit: write "{text}s" for seconds (or ms, m, h, d, w)')
    parts = _PART.findall(text)
    units = [_ORDER.index(unit) for _, unit in parts]
    if not parts or "".join(n + u for n, u in parts) != text or units != sorted(set(units)):
        raise ValueError(f'invalid duration "{text}" (use e.g. 5s, 1m, 1h30m)')
    seconds = sum(float(n) * UNITS[u] for n, u in parts)
    if seconds <= 0:
        raise ValueError(f'duration "{text}" must be positive')
    return seconds


def format_duration(seconds: float) -> str:
    """90 -> 1m30s, 3600 -> 1h, 0.5 -> 500ms: what parse_duration reads back (to the millisecond).
    Weeks are written as days, as PromQL users read them (`7d`)."""
    parts, rest = [], round(seconds * 1000)
    for unit, size_ms in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if rest >= size_ms:
            parts.append(f"{rest // size_ms}{unit}")
            rest %= size_ms
    return "".join(parts) or "0s"


def window_label(seconds: float) -> str:
    """The `window` label value of a sliding window: 60 -> 1m, 100 -> 1m40s."""
    return format_duration(seconds)
