"""A small reader for the Prometheus classic text exposition format (0.0.4), for the lines we keep.

Why not prometheus_client's parser: it walks every character in Python and was most of a
poll's CPU (benchmarks in docs/benchmarks.md). The contract, checked differentially with
hypothesis (tests/sources/test_textformat_fuzz.py): on every valid classic-format sample line
this reader returns exactly prometheus_client's (name, labels, value); on any other line it
either returns what prometheus_client returns or raises ValueError, never a different sample.
Where prometheus_client is laxer than the format (text after the value, `{,}`, no space before
the value, leading whitespace) this reader refuses.

`family_runs` finds the lines of chosen families in a whole body at C speed (one regex pass),
so a reader that needs a fifth of a body never splits or looks at the rest.

Prometheus 3's quoted UTF-8 names (`{"my.metric", "a.b"="1"} 1`) are not the classic format:
such a line raises ValueError here (prometheus_client 0.26 reads them).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
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


def family_runs(names: Iterable[str], ray: bool = False) -> re.Pattern[str]:
    """A pattern whose matches in "\n" + body are the runs of consecutive sample lines of one of
    `names`, each with its leading line feed (group 1; group 2 the name as written: a line's name
    ends at `{`, a blank or the line's end), so `findall` gives (run, name) pairs. With `ray`, a
    `vllm:` name may also be written `ray_vllm:`. The names form a prefix tree, so each line costs
    one walk of its first characters."""
    vllm = [n.removeprefix("vllm:") for n in names if n.startswith("vllm:")]
    other = [n for n in names if not n.startswith("vllm:")]
    alternatives = [f"{'(?:ray_)?' if ray else ''}vllm:{_tree(vllm)}"] if vllm else []
    alternatives += [_tree(other)] if other else []
    end = r"(?=[{ \t\n]|\Z)"
    return re.compile(rf"(\n({'|'.join(alternatives)}){end}[^\n]*(?:\n\2{end}[^\n]*)*)")


def _tree(words: Iterable[str]) -> str:
    """An alternation of `words` as a prefix tree: no character is compared twice."""
    root: dict[str, dict] = {}
    for word in words:
        node = root
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}
    return _branches(root)


def _branches(node: dict[str, dict]) -> str:
    alternatives = [re.escape(char) + _branches(child) for char, child in sorted(node.items()) if char]
    if not alternatives:
        return ""
    if len(alternatives) == 1 and "" not in node:
        return alternatives[0]
    return "(?:" + "|".join(alternatives) + ")" + ("?" if "" in node else "")
