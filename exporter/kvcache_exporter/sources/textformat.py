"""A small reader for the Prometheus classic text exposition format (0.0.4), for the lines we keep.

Why not prometheus_client's parser: it walks every character in Python and was most of a
poll's CPU (benchmarks in docs/benchmarks.md). The contract, checked differentially with
hypothesis (tests/sources/test_textformat_fuzz.py): on every valid classic-format sample line
this reader returns exactly prometheus_client's (name, labels, value); on any other line it
either returns what prometheus_client returns or raises ValueError, never a different sample.
Where prometheus_client is laxer than the format (text after the value, `{,}`, no space before
the value, leading whitespace) this reader refuses.

Prometheus 3's quoted UTF-8 names (`{"my.metric", "a.b"="1"} 1`) are not the classic format:
such a line raises ValueError here (prometheus_client 0.26 reads them).
"""

from __future__ import annotations

import re
from typing import NamedTuple

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_QUOTED = r'"[^"\\]*(?:\\.[^"\\]*)*"'  # unrolled: linear on long values, no per-character alternation
_SAMPLE = re.compile(
    rf"({_NAME})[ \t]*(?:\{{([^\"}}]*(?:{_QUOTED}[^\"}}]*)*)\}})?[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*"
)
_PAIR = re.compile(
    r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"([^"\\]*(?:\\.[^"\\]*)*)"[ \t]*(?:,[ \t]*|$)'
)
# The escapes prometheus_client undoes; any other backslash stays, as it does there.
_ESCAPES = re.compile(r'\\[\\n"]')
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}


class Line(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPES.sub(lambda m: _UNESCAPED[m.group(0)], value)


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _PAIR.match(text, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"malformed labels: {{{text[:80]}}}")
        name = match.group(1)
        if name in labels or name.startswith("__"):
            raise ValueError(f"duplicate or reserved label name {name!r}")
        labels[name] = unescape(match.group(2))
        pos = match.end()
    return labels


def parse_value(text: str) -> float:
    """A sample value as prometheus_client reads it: Python's float, without its `1_000` digit
    grouping or the whitespace it would strip (Go's ParseFloat accepts neither)."""
    if "_" in text or text != text.strip():
        raise ValueError(f"invalid sample value {text[:40]!r}")
    return float(text)


def sample_name(line: str) -> str:
    """The metric name of a sample line, without parsing the rest."""
    end = len(line)
    for stop in ("{", " ", "\t"):
        i = line.find(stop, 0, end)
        if i >= 0:
            end = i
    return line[:end]


def parse_line(line: str) -> Line:
    """One sample line; ValueError on anything that is not valid exposition syntax."""
    return _parse(line)[0]


def _parse(line: str) -> tuple[Line, bool]:
    """The line, and whether its value is exactly what follows its last space (no timestamp)."""
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise ValueError(f"malformed sample line: {line[:120]}")
    name, labels, value = match.groups()
    simple = match.end(3) == len(line) and line[match.start(3) - 1] == " "
    return Line(name, parse_labels(labels) if labels else {}, parse_value(value)), simple


class Reader:
    """parse_line with a memory: vLLM serves the same series every poll, only values change.

    The text before a line's last space (`name{labels}`) is remembered with its parsed name and
    labels, so a line seen before costs a dict lookup and a float(). A remembered head only
    ever meets the value after the last space, and a head is remembered only from a line whose
    value ran from there to its end, so a hit returns exactly what parse_line would. The labels
    dict is shared between polls: callers must not change it. One Reader per source (not
    thread-safe); it forgets everything when it holds more than `max_entries` heads.
    """

    def __init__(self, max_entries: int = 50_000):
        self.max_entries = max_entries
        self._heads: dict[str, tuple[str, dict[str, str]]] = {}

    def parse_line(self, line: str) -> Line:
        head, _, value = line.rpartition(" ")
        known = self._heads.get(head)
        if known is not None and "\t" not in value:
            try:
                return Line(known[0], known[1], parse_value(value))
            except ValueError:
                pass  # let the full parse say what is wrong
        parsed, simple = _parse(line)
        if simple:
            if len(self._heads) >= self.max_entries:
                self._heads.clear()
            self._heads[head] = (parsed.name, parsed.labels)
        return parsed
