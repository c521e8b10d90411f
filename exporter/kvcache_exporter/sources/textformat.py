"""A small reader for the Prometheus classic text exposition format (0.0.4), for the lines we keep.

Why not prometheus_client's parser: it walks every character in Python and was most of a
poll's CPU (benchmarks in docs/benchmarks.md). The contract, checked differentially with
hypothesis (tests/sources/test_textformat_fuzz.py): on every valid classic-format sample line
this reader returns exactly prometheus_client's (name, labels, value); on any other line it
either returns what prometheus_client returns or raises ValueError, never a different sample.
Where prometheus_client is laxer than the format (text after the value, `{,}`, no space before
the value, leading whitespace) this reader refuses.

`family_runs` finds the lines of chosen families in a whole body at C speed (one regex pass),
so a reader that needs a fifth of a body never splits or looks at the rest; `RunFinder` finds
the same runs in a body much like the last one without that pass.

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


class RunFinder:
    """`findall` of a family_runs pattern, for a source whose body is mostly the last one: when
    the text between the last body's runs (its gaps) is all still there, in order, each run in
    between is checked in place (one `startswith`, or the pattern matched at that spot alone),
    so a poll compares the body to the last one at memcmp speed instead of searching it. The
    runs that changed last time are the ones checked alone; what lies between them (gaps and
    runs) is compared in one piece, so a body where the same few counters move costs a handful
    of comparisons.

    Why that is findall's answer: every gap and run but the first starts a line, so a check in
    place is line-aligned; a match depends only on the line it starts at (and lines of the same
    name after it), so a gap that held no match holds none again, and its first line, which
    ended the run before it, ends it again. `patterns` are the ones for a body without and with
    `needle` (text without a line feed, e.g. "ray_vllm:"), whose presence is kept per part, so
    it is known without a scan either. Bodies over `max_chars` are not remembered."""

    def __init__(self, patterns: tuple[re.Pattern[str], re.Pattern[str]], needle: str, max_chars: int):
        self.patterns, self.needle, self.max_chars = patterns, needle, max_chars
        self.gaps: list[str] = []  # the last body's text between its runs: one more than the runs
        self.runs: list[tuple[str, str]] = []  # its (run, name) pairs
        self.holds: list[bool] = []  # whether each run holds the needle
        self.gaps_hold = False
        self.held = False  # whether the last body held the needle (which pattern found its runs)
        self.pieces: list[str | int] = []  # the last body: fixed text, or the index of a run checked alone
        # The runs whose text is not the last body's (index -> their text there), every other
        # byte being the same; None when the body was searched anew.
        self.moved: dict[int, str] | None = None

    def find(self, body: str) -> tuple[list[tuple[str, str]], bool]:
        """The (run, name) pairs `findall` gives, and whether the body holds the needle."""
        last = self.runs
        if self._by_pieces(body):
            self.moved = {
                i: last[i][0] for i in self.pieces if type(i) is int and self.runs[i] is not last[i]
            }
            return self.runs, self.held
        changed = self._in_place(body)
        if changed is not None:
            self.moved = {i: last[i][0] for i in changed}
            self._cut(changed)
            return self.runs, self.held
        self.moved = None
        self.held = self.needle in body
        runs, gaps, end = [], [], 0
        for match in self.patterns[self.held].finditer(body):
            gaps.append(body[end : match.start()])
            runs.append((match.group(1), match.group(2)))
            end = match.end()
        gaps.append(body[end:])
        if len(body) <= self.max_chars:
            self.gaps, self.runs = gaps, runs
            self.holds = [self.needle in run for run, _ in runs]
            self.gaps_hold = any(self.needle in gap for gap in gaps)
            self._cut(set())
        else:
            self.gaps, self.runs, self.holds, self.pieces = [], [], [], []
        return runs, self.held

    def _by_pieces(self, body: str) -> bool:
        """Whether the body is the last one but for the runs checked alone (then those are updated)."""
        if not self.pieces:
            return False
        runs, holds = self.runs[:], self.holds[:]
        at = 0
        for piece in self.pieces:
            if type(piece) is str:
                if not body.startswith(piece, at):
                    return False
                at += len(piece)
                continue
            run = self._run_at(body, at, piece)
            if run is None:
                return False
            if run is not runs[piece][0]:
                runs[piece], holds[piece] = (run, runs[piece][1]), self.needle in run
            at += len(run)
        return at == len(body) and self._commit(runs, holds)

    def _in_place(self, body: str) -> set[int] | None:
        """Which runs changed, each checked in place between the gaps; None when a gap did."""
        if not self.gaps:
            return None
        gaps, runs, holds, changed = self.gaps, self.runs[:], self.holds[:], set()
        at = 0
        for i in range(len(runs)):
            if not body.startswith(gaps[i], at):
                return None
            at += len(gaps[i])
            run = self._run_at(body, at, i)
            if run is None:
                return None
            if run is not runs[i][0]:
                runs[i], holds[i] = (run, runs[i][1]), self.needle in run
                changed.add(i)
            at += len(run)
        ends = body.startswith(gaps[-1], at) and at + len(gaps[-1]) == len(body)
        return changed if ends and self._commit(runs, holds) else None

    def _run_at(self, body: str, at: int, i: int) -> str | None:
        """Run i of the last body if it is at `at` again, else the run the pattern finds there if it is
        of the same name, else None."""
        run, name = self.runs[i]
        if body.startswith(run, at):
            return run
        match = self.patterns[self.held].match(body, at)
        return match.group(1) if match is not None and match.group(2) == name else None

    def _commit(self, runs: list[tuple[str, str]], holds: list[bool]) -> bool:
        """Keep the runs found in place if the needle's presence, so the pattern, is the same."""
        if (self.gaps_hold or any(holds)) != self.held:
            return False
        self.runs, self.holds = runs, holds
        return True

    def _cut(self, alone: set[int]) -> None:
        """The pieces: the last body cut at the runs in `alone`."""
        pieces: list[str | int] = []
        text = [self.gaps[0]]
        for i, (run, _) in enumerate(self.runs):
            if i in alone:
                pieces += ["".join(text), i]
                text = []
            else:
                text.append(run)
            text.append(self.gaps[i + 1])
        self.pieces = [*pieces, "".join(text)]
