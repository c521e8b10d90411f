"""A small reader for the Prometheus text exposition format (0.0.4), for the lines we keep.

Why not prometheus_client's parser: it walks every character in Python and was most of a
poll's CPU (benchmarks in docs/benchmarks.md). This reader matches it sample for sample on
every captured vLLM /metrics (tests/core/test_textformat.py) and is several times faster.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_SAMPLE = re.compile(
    rf'({_NAME})[ \t]*(?:\{{((?:[^"}}]|"(?:[^"\\]|\\.)*")*)\}})?[ \t]+([^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*'
)
_PAIR = re.compile(r'[ \t]*([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"[ \t]*(,|$)')
_ESCAPES = re.compile(r"\\(.)")


class Line(NamedTuple):
    name: str
    labels: dict[str, str]
    value: float


def unescape(value: str) -> str:
    if "\\" not in value:
        return value
    return _ESCAPES.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_labels(text: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    pos = 0
    while pos < len(text):
        match = _PAIR.match(text, pos)
        if match is None:
            raise ValueError(f"malformed labels: {{{text[:80]}}}")
        labels[match.group(1)] = unescape(match.group(2))
        pos = match.end()
    return labels


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
    match = _SAMPLE.fullmatch(line)
    if match is None:
        raise ValueError(f"malformed sample line: {line[:120]}")
    name, labels, value = match.groups()
    return Line(name, parse_labels(labels) if labels else {}, float(value))
