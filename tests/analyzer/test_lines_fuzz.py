"""Property test of the analyzer's line parser on hostile lines (issue 23): any bytes, any JSON shaped
like a trace line, a Batch API line or a hash line, give requests or `file:line: message`, never an
exception. `make fuzz` runs it with FUZZ_EXAMPLES=100000; an input that breaks it is written to
tests/fixtures/fuzz/analyzer-lines/ and replayed here from then on."""

from __future__ import annotations

import hashlib
import io
import json
import os
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.analyzer import trace
from kvcache_exporter.analyzer.blocktrace import parse_lines
from kvcache_exporter.analyzer.lines import read_lines
from tests.fuzzing import fuzz_settings

FUZZ = fuzz_settings(1000)
KEYS = [
    "prompt_token_ids",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "completion_token_ids",
    "session",
    "user",
    "send_ts",
    "timestamp",
    "server_instance",
    "i",
    "phase",
    "hash_ids",
    "input_length",
    "output_length",
    "chat_id",
    "parent_chat_id",
    "custom_id",
    "url",
    "body",
    "role",
    "content",
    "text",
]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=20),
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "user", "system", "-1", "raw"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.sampled_from(KEYS), inner, max_size=6)
    ),
    max_leaves=40,
)
LINES = st.one_of(
    st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=8).map(json.dumps),
    VALUES.map(json.dumps),
    st.binary(max_size=200).map(lambda b: b.decode("latin-1")),
    st.integers(1, 3000).map(lambda depth: "[" * depth + "]" * depth),
)


REGRESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "analyzer-lines"


def check(lines: list[str]) -> None:
    raw = "\n".join(lines).encode("utf-8", "surrogatepass") + b"\n"
    try:
        check_bytes(raw)
    except BaseException:
        if os.environ.get("FUZZ_SAVE"):
            REGRESSIONS.mkdir(parents=True, exist_ok=True)
            (REGRESSIONS / f"{hashlib.sha256(raw).hexdigest()[:16]}.jsonl").write_bytes(raw)
        raise


def check_bytes(raw: bytes) -> None:
    numbered = list(read_lines(io.BytesIO(raw), max_bytes=4096))
    parsed = parse_lines(numbered, "fuzz.jsonl", 16)
    assert len(parsed.requests) + len(parsed.skipped) <= len(numbered)
    assert all(s.startswith("fuzz.jsonl:") for s in parsed.skipped)
    for r in parsed.traces:
        assert (
            0 < len(r.prompt_token_ids) <= trace.MAX_PROMPT_TOKENS
            and 1 <= r.max_tokens <= trace.MAX_GENERATED
        )
        assert r.forced_output is None or isinstance(r.forced_output, list)
    for r in parsed.requests:
        assert r.prompt_tokens >= 1 and 1 <= r.max_tokens <= trace.MAX_GENERATED


@FUZZ
@given(st.lists(LINES, min_size=1, max_size=6))
def test_any_lines_give_requests_or_named_messages(lines):
    check(lines)


@FUZZ
@given(st.lists(LINES, min_size=1, max_size=4), st.sampled_from([0, 1]))
def test_after_a_good_first_line(lines, kind):
    first = [json.dumps({"prompt_token_ids": [1, 2, 3]}), json.dumps({"hash_ids": [1], "input_length": 5})]
    check([first[kind], *lines])


def test_kept_regressions_keep_the_contract():
    """Every input `make fuzz` kept (none yet) is replayed."""
    for path in sorted(REGRESSIONS.glob("*.jsonl")) if REGRESSIONS.is_dir() else []:
        check_bytes(path.read_bytes())
