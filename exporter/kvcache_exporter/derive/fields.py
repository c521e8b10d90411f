"""Name the per-request field in front of known content, and redact that front to a shape. Pure.

`classify(text, rules)` finds the dynamic fields of a decoded front (the seed's rules: ISO
timestamps, `[TS:123]` tags, `{TEMPLATE_VARS}`; and dates, times, UUIDs, emails, URLs, hex, ids,
long numbers; then the user's named patterns, tried first). The field that broke the prefix is the
first one found (`other` when none is). `shape(text, found)` is the only text that leaves the
process: every field becomes `<kind>`, every other run of letters or digits a shape class
(`<Word>`, `<word>`, `<WORD>`, `<alnum>`, `<n>`), every character outside a few structural
punctuation marks `?`: no word, name or number of the prompt survives.

User patterns are bounded in time at start-up (`Rules.with_patterns`): Python's `re` cannot be
interrupted, so a pattern whose syntax can backtrack badly (a repeat inside a repeat, alternatives
under a repeat, back-references, look-arounds, more than two open-ended repeats) is refused, and the
rest must scan adversarial texts of the longest front within a time budget.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import NamedTuple

MAX_TEXT = 512
"""characters of a decoded front looked at: what fits 64 tokens of any real vocabulary"""

KINDS = (
    "timestamp",
    "date",
    "time",
    "uuid",
    "email",
    "url",
    "hex",
    "id",
    "number",
    "template",
    "other",
)
_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]{0,6}\.?"
# In priority order: at one position the first alternative that matches wins.
_BUILTIN = [
    ("url", r"\b(?:https?://|www\.)[^\s<>\"']{1,200}"),
    ("email", r"\b[\w.+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){1,8}\b"),
    ("uuid", r"\b[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}\b"),
    (
        "timestamp",
        r"\b\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}(?::\d{2}(?:[.,]\d{1,9})?)?(?:Z|[+-]\d{2}:?\d{2})?"
        r"|\[TS:\s?\d{1,20}(?:\]|$)",
    ),
    (
        "date",
        r"\b\d{4}-\d{2}-\d{2}\b|\b\d{1,2}[/.]\d{1,2}[/.]\d{2,4}\b"
        rf"|\b{_MONTH} \d{{1,2}},? \d{{4}}\b",
    ),
    ("time", r"\b\d{1,2}:\d{2}(?::\d{2})?(?:\s?[AaPp][Mm])?\b"),
    ("id", r"\[[A-Z]{1,12}:\s?[\w-]{1,64}(?:\]|$)|#\d{2,20}\b"),  # a tag may be cut where the front ends
    ("hex", r"\b(?:0x)?(?=[0-9a-fA-F]{0,63}[a-fA-F])(?=[0-9a-fA-F]{0,63}\d)[0-9a-fA-F]{8,64}\b"),
    ("id", r"\b(?=[A-Za-z_-]{0,31}\d)(?=[\w-]{0,31}[A-Za-z])(?=(?:[A-Za-z_-]{0,16}\d){3})[\w-]{4,48}\b"),
    ("number", r"\b\d{4,}(?:[.,]\d+)?\b"),
    ("template", r"\{\{?\s?[A-Za-z_][A-Za-z0-9_]{0,63}\s?\}?\}"),
]
BUILTIN = re.compile("|".join(f"(?P<{kind}{i}>{rx})" for i, (kind, rx) in enumerate(_BUILTIN)))
_KIND_OF_GROUP = {f"{kind}{i}": kind for i, (kind, _) in enumerate(_BUILTIN)}

MAX_PATTERNS = 8
PATTERN_NAME = re.compile(r"[a-z][a-z0-9_]{0,23}")
PATTERN_BUDGET_S = 0.05
"""the longest one adversarial scan of MAX_TEXT characters may take"""
_OPEN_ENDED = 64  # a repeat allowing more than this many counts as open-ended


class Field(NamedTuple):
    kind: str
    start: int
    end: int


class Rules(NamedTuple):
    """The user's named patterns (tried before the built-in ones) and the kinds they add."""

    patterns: tuple[tuple[str, re.Pattern], ...] = ()

    @property
    def kinds(self) -> tuple[str, ...]:
        return (*(name for name, _ in self.patterns), *KINDS)

    @classmethod
    def with_patterns(cls, named: dict[str, str]) -> Rules:
        """`named`: name -> regex; ValueError names every refused pattern."""
        problems, patterns = [], []
        if len(named) > MAX_PATTERNS:
            problems.append(f"{len(named)} patterns: at most {MAX_PATTERNS}")
        for name, pattern in named.items():
            try:
                patterns.append((name, vet_pattern(name, pattern)))
            except ValueError as err:
                problems.append(f"{name}: {err}")
        if problems:
            raise ValueError("; ".join(problems))
        return cls(tuple(patterns))


NO_RULES = Rules()


def classify(text: str, rules: Rules | None = None) -> list[Field]:
    """The fields of `text` (its first MAX_TEXT characters), in order, never overlapping; at one
    position the user's patterns win over the built-in ones."""
    text, rules = text[:MAX_TEXT], rules or NO_RULES
    found = [Field(name, m.start(), m.end()) for name, rx in rules.patterns for m in rx.finditer(text)]
    found += [Field(_KIND_OF_GROUP[m.lastgroup], m.start(), m.end()) for m in BUILTIN.finditer(text)]
    if rules.patterns:
        order = {name: i for i, name in enumerate(rules.kinds)}
        found.sort(key=lambda f: (f.start, order.get(f.kind, len(order)), -f.end))
    out: list[Field] = []
    for field in found:
        if field.end > field.start and (not out or field.start >= out[-1].end):
            out.append(field)
    return out


def first_kind(found: list[Field]) -> str:
    """The field that broke the prefix: the first one in front of the known content."""
    return found[0].kind if found else "other"


_KEPT = " []{}()<>:;,.-/=#'\""
_PLAIN = re.compile(r"[^\W_]+|[^\s" + re.escape(_KEPT) + "]")  # a run of letters/digits, or one other mark
MAX_SHAPE = 400


def _plain_class(match: re.Match) -> str:
    run = match.group()
    if not run[0].isalnum():
        return "?"
    if run.isdigit():
        return "<n>"
    if not run.isalpha():
        return "<alnum>"
    if run.isupper() and len(run) > 1:
        return "<WORD>"
    return "<Word>" if run[0].isupper() else "<word>"


def shape(text: str, found: list[Field]) -> str:
    """The redacted front: fields as `<kind>`, runs of letters/digits as a class, any character
    but a few punctuation marks as `?`, whitespace as one space; at most MAX_SHAPE characters."""
    text, parts, at = text[:MAX_TEXT], [], 0
    for field in found:
        parts += [_PLAIN.sub(_plain_class, text[at : field.start]), f"<{field.kind}>"]
        at = field.end
    parts.append(_PLAIN.sub(_plain_class, text[at:]))
    return " ".join("".join(parts).split())[:MAX_SHAPE]


def vet_pattern(
    name: str, pattern: str, budget: float = PATTERN_BUDGET_S, clock: Callable[[], float] = time.perf_counter
) -> re.Pattern:
    """Compile a user pattern, or ValueError: its name is a bounded label value, its syntax cannot
    backtrack exponentially, and it scans adversarial MAX_TEXT-character texts within `budget`."""
    if not PATTERN_NAME.fullmatch(name) or name in KINDS:
        raise ValueError(f"the name must match {PATTERN_NAME.pattern} and not be one of {', '.join(KINDS)}")
    if len(pattern) > 200:
        raise ValueError("longer than 200 characters")
    try:
        compiled = re.compile(pattern)
        tree = _parse(pattern)
    except (re.error, RecursionError, OverflowError) as err:
        raise ValueError(f"not a regular expression: {err}") from None
    if compiled.match(""):
        raise ValueError("matches the empty text")
    problem = _syntax_problem(tree)
    if problem:
        raise ValueError(problem)
    for text in _adversarial(pattern):
        start = clock()
        for _ in compiled.finditer(text):
            pass
        if clock() - start > budget:
            raise ValueError(f"too slow: over {budget * 1000:.0f} ms on a {len(text)}-character text")
    return compiled


def _parse(pattern: str):
    try:
        from re import _parser as parser  # Python 3.11+
    except ImportError:  # pragma: no cover
        import sre_parse as parser
    return parser.parse(pattern)


def _syntax_problem(tree) -> str | None:
    from re import _constants as c

    open_ended = 0

    def walk(items, under_repeat: bool) -> str | None:
        nonlocal open_ended
        for op, arg in items:
            if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
                _, high, sub = arg
                if under_repeat and high > 1:
                    return "a repeat inside a repeat can backtrack exponentially"
                if high > _OPEN_ENDED:
                    open_ended += 1
                problem = walk(sub, under_repeat or high > 1)
                if problem:
                    return problem
            elif op in (c.GROUPREF, c.GROUPREF_EXISTS):
                return "back-references are not allowed"
            elif op in (c.ASSERT, c.ASSERT_NOT):
                return "look-arounds are not allowed"
            elif op is c.SUBPATTERN:
                problem = walk(arg[-1], under_repeat)
                if problem:
                    return problem
            elif op is c.BRANCH:
                if under_repeat:
                    return "alternatives under a repeat can backtrack exponentially"
                for branch in arg[1]:
                    problem = walk(branch, under_repeat)
                    if problem:
                        return problem
            elif op in (getattr(c, "ATOMIC_GROUP", None),):
                problem = walk(arg, under_repeat)
                if problem:
                    return problem
        return None

    problem = walk(tree, False)
    if problem is None and open_ended > 2:
        return f"{open_ended} open-ended repeats (at most 2): bound them, e.g. {{1,20}}"
    return problem


def _adversarial(pattern: str) -> list[str]:
    """Texts that make a backtracking scan work hardest: long runs of one character class, and of
    the pattern's own characters, without the ending the pattern needs."""
    own = "".join(dict.fromkeys(ch for ch in pattern if ch.isprintable() and ch not in "\\()[]{}|*+?^$"))
    seeds = ["a", "A", "0", " ", "-", ".", ":", "_", "a0", "aA0-_. :/@", own or "x"]
    texts = []
    for length in (64, 256, MAX_TEXT):
        texts += [(seed * (length // len(seed) + 1))[:length] for seed in seeds]
        texts += [(seed * (length // len(seed) + 1))[: length - 1] + "\x00" for seed in seeds]
    return texts
