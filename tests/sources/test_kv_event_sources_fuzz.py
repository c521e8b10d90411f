"""Hostile discovery answers (issue 33, "Discovery"): whatever an engine's route answers (any JSON,
entries naming another host, other schemes, thousands of ranks, bad ports, bytes that are not JSON),
`read_answer` returns streams on the polled host only, within the rank and field bounds, or raises
a SourceError; nothing else. Every engine in ENGINES is fuzzed, so a new route (SGLang's
/server_info) is covered as soon as it is added. `make fuzz` runs 100,000 cases."""

from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.kv_event_sources import (
    ENGINES,
    MAX_FIELD_CHARS,
    MAX_RANKS,
    Found,
    read_answer,
)
from tests.fuzzing import fuzz_settings

HOSTS = st.sampled_from(["127.0.0.1", "vllm-0.pool.svc", "::1", "10.1.2.3"])
ENDPOINTS = st.builds(
    "{}://{}:{}".format,
    st.sampled_from(["tcp", "ipc", "inproc", "http", "TCP", ""]),
    st.sampled_from(["*", "0.0.0.0", "[::]", "evil.example", "169.254.169.254", "127.0.0.1", "[::1]", ""]),
    st.sampled_from(["5557", "0", "65535", "65536", "99999", "-1", "5557/x", "", "0x15"]),
) | st.text(max_size=40)
SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=20)
ENTRY = st.fixed_dictionaries(
    {"endpoint": ENDPOINTS | SCALARS},
    optional={
        "publisher": st.sampled_from(["zmq", "null", None, 7]),
        "enable_kv_cache_events": st.booleans() | SCALARS,
        "replay_endpoint": ENDPOINTS | SCALARS,
        "topic": st.text(max_size=MAX_FIELD_CHARS + 8) | SCALARS,
        "data_parallel_rank": st.integers(-3, MAX_RANKS + 3) | st.text(max_size=8) | SCALARS,
    },
)
RANK_KEYS = st.integers(-3, 10_000).map(str) | st.text(max_size=8)
SHAPED = (
    st.dictionaries(RANK_KEYS, ENTRY | SCALARS, max_size=80)
    | st.lists(ENTRY | SCALARS, max_size=80)
    | st.fixed_dictionaries({"sources": st.lists(ENTRY | SCALARS, max_size=80)})
)
ANY_JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=5), inner, max_size=5),
    max_leaves=30,
)


def body(answer) -> bytes:
    return json.dumps(answer, allow_nan=True).encode()


BODIES = (
    (SHAPED | ANY_JSON).map(body)
    | st.binary(max_size=200)
    | st.integers(1, 50_000).map(lambda depth: b"[" * depth + b"]" * depth)  # deep nesting
    | st.integers(MAX_RANKS, 3 * MAX_RANKS).map(
        lambda n: body({str(r): {"endpoint": f"tcp://*:{5557 + r}"} for r in range(n)})  # thousands of ranks
    )
)


@given(BODIES, HOSTS, st.sampled_from(sorted(ENGINES)))
@fuzz_settings(500)
def test_any_answer_gives_streams_on_the_polled_host_within_bounds_or_a_parse_error(raw, host, engine):
    try:
        found = read_answer(raw, ENGINES[engine], host)
    except SourceError as err:
        assert err.reason == "parse_error"
        return
    assert isinstance(found, Found)
    assert len(found.streams) <= MAX_RANKS
    assert len({s.rank for s in found.streams}) == len(found.streams)  # one stream a rank
    polled = f"[{host}]" if ":" in host else host
    for stream in found.streams:
        assert 0 <= stream.rank < MAX_RANKS
        assert stream.mode in ("bind", "connect")
        assert len(stream.topic) <= MAX_FIELD_CHARS
        for endpoint in (stream.endpoint, stream.replay_endpoint):
            if endpoint is None:
                continue
            named, _, port = endpoint.removeprefix("tcp://").rpartition(":")
            assert endpoint.startswith("tcp://") and named == polled  # never a target from the data
            assert 0 < int(port) < 65536
    assert all(count > 0 for count in found.rejected.values())
    assert set(found.other_host) <= {s.rank for s in found.streams}
