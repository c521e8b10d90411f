"""RunFinder (textformat.py) finds exactly what its pattern's `findall` finds, poll after poll.

The finder checks a body in place against the last one (its gaps, its runs) instead of searching
it; these properties start from real captures (read in place from ../shared) and edit them from
poll to poll as an upstream might: values move, lines appear, vanish, move or change family, and
"ray_vllm:" turns up in a comment or a label, which switches the pattern.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.sources.textformat import RunFinder, family_runs
from kvcache_exporter.sources.vllm_names import DEPRECATED
from kvcache_exporter.sources.vllm_parse import _READ, Memory
from kvcache_exporter.tools.bench_side_by_side import PAYLOAD, growing_payload
from tests.conftest import exposition_captures
from tests.fuzzing import fuzz_settings

WANTED = _READ | DEPRECATED
ALL_BODIES = [p.read_text().splitlines() for p in exposition_captures()]
NAMES = sorted({line.split("{")[0].split(" ")[0] for body in ALL_BODIES for line in body if line[:1] != "#"})
# vLLM's pages: the finder looks for vLLM's families (SGLang's captures have none of them)
BODIES = [body for body in ALL_BODIES if any(line.split("{")[0].split(" ")[0] in WANTED for line in body)]


def findall(finder: RunFinder, body: str) -> tuple[list[tuple[str, str]], bool]:
    held = finder.needle in body
    return finder.patterns[held].findall(body), held


def test_a_growing_payload_is_found_as_findall_finds_it():
    """The side-by-side bench's targets: two counters move every poll, and their values grow longer."""
    render = growing_payload(PAYLOAD.read_text())
    finder = Memory().finder
    for n in [*range(1, 40), 99, 100, 101, 9999, 10000, 10001, 5, 5]:
        body = "\n" + render(n).decode()
        assert finder.find(body) == findall(finder, body), n


def name_of(line: str) -> str:
    return line.split("{")[0].split(" ")[0]


def edit(lines: list[str], hot: list[int], draw) -> list[str]:
    """One edit, mostly at one of a few `hot` lines (the same spots move poll after poll)."""
    lines = list(lines)
    i = draw(st.sampled_from(hot) | st.integers(0, 10**6)) % max(len(lines), 1)
    line = lines[i] if lines else ""
    kinds = ["value", "value", "rename", "drop", "copy", "append", "move", "ray", "label", "blank"]
    kind = draw(st.sampled_from(kinds))
    if kind == "value" and " " in line:
        lines[i] = line.rsplit(" ", 1)[0] + " " + draw(st.sampled_from(["0.0", "1.0", "12345.0", "7", "NaN"]))
    elif kind == "rename" and line[:1] != "#":
        name = name_of(line)
        neighbours = [name_of(lines[j]) for j in (i - 1, i + 1) if 0 <= j < len(lines)]
        alike = [n for n in sorted(WANTED) if len(n) == len(name)]  # a gap of the same length, now a run
        lines[i] = draw(st.sampled_from([*neighbours, *alike, "ray_" + name, *NAMES])) + line[len(name) :]
    elif kind == "drop" and lines:
        del lines[i]
    elif kind == "copy":
        lines.insert(draw(st.integers(0, len(lines))), line)
    elif kind == "append":
        lines.append(line)
    elif kind == "label" and "{" in line:
        lines[i] = line.replace("{", '{x="ray_vllm:",', 1)
    elif kind == "move" and lines:
        lines.insert(draw(st.integers(0, len(lines) - 1)), lines.pop(i))
    elif kind == "ray":
        text = draw(
            st.sampled_from(["# HELP x see ray_vllm:y", 'vllm:num_requests_running{a="ray_vllm:"} 1'])
        )
        lines.insert(draw(st.integers(0, len(lines))), text)
    elif kind == "blank":
        lines.insert(draw(st.integers(0, len(lines))), "")
    return lines


@st.composite
def polls(draw) -> list[str]:
    """A few bodies of one source, each the last one with a few edits."""
    lines = BODIES[draw(st.integers(0, len(BODIES) - 1))]
    hot = draw(st.lists(st.sampled_from([i for i, line in enumerate(lines) if name_of(line) in WANTED]),
                        min_size=1, max_size=3))  # fmt: skip
    bodies = []
    for _ in range(draw(st.integers(2, 8))):
        for _ in range(draw(st.integers(0, 3))):
            lines = edit(lines, hot, draw)
        bodies.append("\n" + "\n".join(lines) + draw(st.sampled_from(["\n", ""])))
    return bodies


@given(polls())
@fuzz_settings(1000)
def test_edited_real_bodies_are_found_as_findall_finds_them(bodies):
    finder = Memory().finder
    for body in bodies:
        assert finder.find(body) == findall(finder, body)


@pytest.mark.parametrize(
    "last", ["\nvllm:aa 1\nvllm:bb 2\nvllm:cc 3\nvllm:dd 4", "\nvllm:aa 1\nvllm:bb 2\nvllm:cc 3"]
)
def test_a_gap_that_becomes_a_run_of_the_same_length_is_seen(last):
    """Every piece of text is compared, not only its length: a line between runs (here the middle
    one, or the last) that turns into one of the runs' family keeps the body's length."""
    finder = RunFinder((family_runs({"vllm:aa", "vllm:cc"}),) * 2, "ray_vllm:", 1 << 20)
    for body in (last, last, last.replace("bb", "aa"), last, last.replace("dd", "cc"), last[:-1] + "5"):
        assert finder.find(body) == findall(finder, body), body


def test_a_body_over_the_limit_is_searched_and_not_remembered():
    body = "\n" + "\n".join(BODIES[0])
    small = Memory(max_run_chars=len(body) - 1).finder
    for _ in range(2):
        assert small.find(body) == findall(small, body)
        assert small.gaps == [] and small.pieces == []
