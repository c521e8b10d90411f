"""fleet_wire.py: the NATS deltas' ranges, subjects and bounds (pure; the NATS tests are in
tests/aggregator/test_nats_intake.py)."""

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter import fleet_wire as wire
from kvcache_exporter.aggregator.fleet_residency import HashRange

POSITIONS = st.integers(0, (1 << 64) - 1)
SAMPLING = st.sampled_from([1.0, 0.5, 0.3, 0.01])


@given(POSITIONS, SAMPLING)
def test_a_hash_is_in_the_range_whose_hash_range_bounds_hold_it(position, sampling):
    kept = wire.kept_space(sampling)
    r = wire.range_of(position, kept)
    if position >= kept:
        assert r is None and not HashRange(sampling).keep([position])
        return
    lo, hi = HashRange(sampling, r, wire.RANGES).bounds
    assert lo <= position < hi


def matches(subject: str, pattern: str) -> bool:
    """NATS subject matching: `*` one token, `>` one or more at the end."""
    tokens = {"*": r"[^.]+", ">": r".+"}
    regex = r"\.".join(tokens.get(token, re.escape(token)) for token in pattern.split("."))
    return re.fullmatch(regex, subject) is not None


@given(
    POSITIONS, SAMPLING, st.integers(1, 70).flatmap(lambda n: st.tuples(st.integers(0, n - 1), st.just(n)))
)
def test_a_shard_reads_the_subject_of_every_hash_it_keeps(position, sampling, shard):
    k, n = shard
    kept = wire.kept_space(sampling)
    r = wire.range_of(position, kept)
    hash_range = HashRange(sampling, k, n)
    filters = wire.subject_filters("kvcache", "p", hash_range.bounds, sampling)
    subject = wire.delta_subject("kvcache", "p", r, "rep-1") if r is not None else None
    if hash_range.keep([position]):
        assert any(matches(subject, f) for f in filters)
    if n & (n - 1) == 0 and n <= wire.RANGES:  # a power of two: one filter, exactly its ranges
        assert len(filters) == 1
        if subject is not None:
            assert matches(subject, filters[0]) == bool(hash_range.keep([position]))


def test_filters_of_all_shards_cover_each_range_once_or_twice_at_a_boundary():
    for n in (1, 2, 3, 5, 64, 100):
        reads = [0] * wire.RANGES
        for k in range(n):
            filters = wire.subject_filters("kvcache", "p", HashRange(1.0, k, n).bounds, 1.0)
            for r in range(wire.RANGES):
                reads[r] += any(matches(wire.delta_subject("kvcache", "p", r, "x"), f) for f in filters)
        assert min(reads) >= 1 and (max(reads) <= 2 or n > wire.RANGES)


def test_a_delta_round_trips_and_is_checked_against_its_subject():
    change = wire.Change(True, [1, b"\x01" * 32], group=2, adapter="lora-a", session="s")
    delta = wire.Delta(wire.VERSION, "pool", "rep-1", 0, 7, 5, 1, 9, 1.0, 2.5, [change])
    subject = wire.delta_subject("kvcache", "pool", 7, "rep-1")
    assert subject == "kvcache.pool.d.0.0.0.1.1.1.rep-1"
    assert wire.decode_delta(wire.encode(delta), subject, "kvcache", "pool") == delta
    with pytest.raises(wire.WireError) as err:
        wire.decode_delta(wire.encode(delta), subject.replace("rep-1", "rep-2"), "kvcache", "pool")
    assert err.value.reason == "forged"


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"replica": "a.b"}, "parse_error"),  # a dot would be a subject token of its own
        ({"replica": "*"}, "parse_error"),
        ({"range": 64}, "parse_error"),
        ({"sampling": 0.0}, "parse_error"),
        ({"changes": [[True, [1] * (wire.MAX_HASHES_PER_DELTA + 1)]]}, "parse_error"),  # over the bound
        ({"kind": "tensorrt"}, "unknown_engine"),  # an engine no shard knows the hashes of
        ({"kind": "x" * 17}, "parse_error"),
        ({"kind": 3}, "parse_error"),
    ],
)
def test_malformed_deltas_name_their_reason(fields, reason):
    base = {"version": 1, "pool": "pool", "replica": "a", "engine": 0, "range": 0, "epoch": 1, "cause": 0,
            "seq": 0, "sampling": 1.0, "ts": 1.0, "changes": []}  # fmt: skip
    payload = msgspec.msgpack.encode(list({**base, **fields}.values()))
    with pytest.raises(wire.WireError) as err:
        wire.decode_delta(payload, wire.delta_subject("kvcache", "pool", 0, "a"), "kvcache", "pool")
    assert err.value.reason == reason


def test_split_keeps_order_and_drops_hashes_outside_the_sample():
    kept = wire.kept_space(0.5)
    low, high = 5, (1 << 63) + 5  # in the sample, outside it
    assert wire.split([low, high, low + 1], kept) == {0: [low, low + 1]}
    assert wire.split([b"\x00" * 24 + (5).to_bytes(8, "big")], kept) == {
        0: [b"\x00" * 24 + (5).to_bytes(8, "big")]
    }


def test_encode_delta_writes_the_bytes_of_the_delta_struct_it_does_not_build():
    changes = [(True, [1, b"\x01" * 32], 2, "lora-a", "s"), (False, [3], None, None, None)]
    bulk = wire.encode_delta("pool", "rep-1", 0, 7, 5, 1, 9, 1.0, 2.5, changes)
    delta = wire.Delta(
        wire.VERSION, "pool", "rep-1", 0, 7, 5, 1, 9, 1.0, 2.5, [wire.Change(*c) for c in changes]
    )
    assert bulk == wire.encode(delta)
    assert (
        wire.decode_delta(bulk, wire.delta_subject("kvcache", "pool", 7, "rep-1"), "kvcache", "pool") == delta
    )


def test_the_engine_travels_and_a_delta_from_before_it_reads_as_vllms():
    subject = wire.delta_subject("kvcache", "pool", 7, "rep-1")
    changes = [(True, [1, 2], None, None, None)]
    sglang = wire.encode_delta("pool", "rep-1", 0, 7, 5, 1, 9, 1.0, 2.5, changes, "sglang")
    assert wire.decode_delta(sglang, subject, "kvcache", "pool").kind == "sglang"
    old = msgspec.msgpack.encode([1, "pool", "rep-1", 0, 7, 5, 1, 9, 1.0, 2.5, [list(changes[0])]])
    assert wire.decode_delta(old, subject, "kvcache", "pool").kind == "vllm"
