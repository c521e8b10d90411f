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


def parse_line(line: str) -> Line:
    """One sample line; ValueError on anything that is not valid exposition syntax."""
    return parse_line_and_head(line)[0]


def parse_line_and_head(line: str) -> tuple[Line, str | None]:
    """The line, and its head (the text before its last space) when its value runs from there to
    the line's end (no timestamp, no trailing blank): the same head with any other value there
    is then the same series, which lets a caller remember heads (sources/vllm_parse.py)."""
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise ValueError(f"malformed sample line: {line[:120]}")
    name, labels, value = match.groups()
    start = match.start(3)
    head = line[: start - 1] if match.end(3) == len(line) and line[start - 1] == " " else None
    return Line(name, parse_labels(labels) if labels else {}, parse_value(value)), head
