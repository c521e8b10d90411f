"""Property tests of the KV-event decoder and EventState, seeded from the real vLLM 0.32 frames.

The contract (issue 14): no exception but KvEventDecodeError leaves the decoder, none at all
leaves the state, every exported value is finite and non-negative, the tracked set stays within
its bound. Heavy but valid batches (issue 23) are applied within the per-batch bounds and refused
(`batch_too_heavy`) beyond them; a drain under any time budget is applied or dropped, never missed.
`make fuzz` runs the same properties with FUZZ_EXAMPLES=100000; an input that breaks them is
written to tests/fixtures/fuzz/kv-events/ and replayed here from then on.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from unittest import mock

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_exporter.derive import kv_budget
from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState, kv_event_samples
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState, PollState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.kv_events_decode import (
    DROP_REASONS,
    MAX_BATCH_BYTES,
    MAX_BLOCK_SIZE,
    MAX_HASH_BYTES,
    MAX_HASHES_PER_BATCH,
    MAX_HASHES_PER_EVENT,
    MAX_TOKENS_PER_BATCH,
    Batch,
    Dropped,
    Event,
    KvEventDecodeError,
    KvEventDrain,
    decode_message,
)
from tests.fuzzing import fuzz_settings

from .conftest import load_seed_kv_frames

REGRESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "kv-events"
FUZZ = fuzz_settings(1000)
EXAMPLES = FUZZ.max_examples
REAL = load_seed_kv_frames()
MAX_BLOCKS = 64


def check(messages: list[list[bytes]]) -> None:
    """Feed messages through decode + state the way the subscriber does, asserting the contract."""
    state = EventState(max_blocks=MAX_BLOCKS)
    try:
        for frames in messages:
            try:
                state.apply(decode_message(frames))
            except KvEventDecodeError as err:
                state.drop(err.reason, err.seq)
        for sample in kv_event_samples(state):
            assert math.isfinite(sample.value) and sample.value >= 0, sample
        assert state.cached_blocks <= MAX_BLOCKS
    except BaseException:
        if os.environ.get("FUZZ_SAVE"):
            keep(messages)
        raise


def keep(messages: list[list[bytes]]) -> None:
    blob = msgspec.msgpack.encode(messages)
    REGRESSIONS.mkdir(parents=True, exist_ok=True)
    (REGRESSIONS / f"{hashlib.sha256(blob).hexdigest()[:16]}.msgpack").write_bytes(blob)


real_message = st.sampled_from(REAL)


@st.composite
def mutated(draw) -> list[bytes]:
    """A real message with bytes flipped, cut, inserted or spliced from another message."""
    topic, seq, payload = draw(real_message)
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(("flip", "cut", "insert", "splice", "seq")))
        at = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "splice":
            other = draw(real_message)[2]
            start = draw(st.integers(0, len(other) - 1))
            data[at:] = other[start:]
        else:
            seq = draw(st.sampled_from((0, 1, 2**32, 2**63, 2**64 - 1))).to_bytes(8, "big")
    return [topic, seq, bytes(data)]


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=80),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
    max_leaves=30,
)  # fmt: skip
event_types = st.sampled_from(("BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockPinned"))


@st.composite
def shaped(draw) -> list[bytes]:
    """A message shaped like a batch, with fields of any type: what a different or broken publisher sends."""
    event = st.one_of(
        st.fixed_dictionaries({"type": event_types}, optional={"block_hashes": msgpack_values}),
        st.tuples(event_types, msgpack_values).map(list),
        msgpack_values,
    )
    batch = st.one_of(
        st.tuples(msgpack_values | st.floats(), st.lists(event, max_size=6), msgpack_values).map(list),
        st.fixed_dictionaries({"ts": st.floats(), "events": st.lists(event, max_size=6)}),
    )
    seq = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "big")
    return [b"kv", seq, msgspec.msgpack.encode(draw(batch))]


@FUZZ
@given(st.lists(mutated(), min_size=1, max_size=8))
def test_mutated_real_messages_keep_the_contract(messages):
    check(messages)


@FUZZ
@given(st.lists(st.one_of(shaped(), real_message.map(list)), min_size=1, max_size=8))
def test_batch_shaped_messages_of_any_types_keep_the_contract(messages):
    check(messages)


@FUZZ
@given(st.lists(st.lists(st.binary(max_size=64), min_size=0, max_size=4), min_size=1, max_size=8))
def test_arbitrary_frames_keep_the_contract(messages):
    check(messages)


@pytest.mark.parametrize(
    "path", sorted(REGRESSIONS.glob("*.msgpack")) if REGRESSIONS.is_dir() else [], ids=lambda p: p.stem
)
def test_kept_regressions_keep_the_contract(path):
    check([list(m) for m in msgspec.msgpack.decode(path.read_bytes())])


# --- heavy but valid (issue 23): every message is well-formed; only its size varies --------------

# Each example builds up to ~1M-element lists: a twentieth of the examples keeps `make fuzz` in minutes.
HEAVY_FUZZ = settings(FUZZ, max_examples=max(EXAMPLES // 20, 50))
near = st.sampled_from((-1, 0, 1))


@st.composite
def heavy_valid(draw) -> tuple[list[bytes], int, int]:
    """A valid batch near the heavy-batch bounds, in either encoding: (frames, hashes, token ids).
    Every event stays within its own bounds; the batch's total hashes, token ids and bytes vary."""
    total = draw(st.integers(0, 2 * MAX_HASHES_PER_BATCH) | near.map(lambda d: MAX_HASHES_PER_BATCH + d))
    events = draw(st.integers(1, 300))
    sizes = [min(total // events + (i < total % events), MAX_HASHES_PER_EVENT) for i in range(events)]
    tokens_total = draw(
        st.integers(0, MAX_TOKENS_PER_BATCH + 16) | near.map(lambda d: MAX_TOKENS_PER_BATCH + d)
    )
    tokens = [tokens_total // events + (i < tokens_total % events) for i in range(events)]
    block_hash = draw(
        st.integers(0, 127) | st.integers(2**32, 2**64 - 1) | st.binary(min_size=1, max_size=MAX_HASH_BYTES)
    )
    token = draw(st.integers(0, 2**31 - 1))
    array_events, array_batch = draw(st.booleans()), draw(st.booleans())
    out = []
    for n, t in zip(sizes, tokens, strict=True):
        hashes, token_ids = [block_hash] * n, [token] * t
        size = 16 if t >= 16 * n else 0  # a size the ids contradict is refused (block size read from them)
        if array_events:
            out.append(["BlockStored", hashes, None, token_ids, size, None])
        else:
            out.append(
                {"type": "BlockStored", "block_hashes": hashes, "token_ids": token_ids, "block_size": size}
            )
    batch = [1.0, out, 0] if array_batch else {"ts": 1.0, "events": out, "data_parallel_rank": 0}
    seq = draw(st.integers(0, 2**64 - 1)).to_bytes(8, "big")
    return [b"kv", seq, msgspec.msgpack.encode(batch)], sum(sizes), sum(tokens)


@HEAVY_FUZZ
@given(heavy_valid(), st.booleans())
def test_heavy_valid_batches_are_applied_within_the_bounds_and_refused_beyond(heavy, with_tokens):
    frames, hashes, tokens = heavy
    over = (
        len(frames[-1]) > MAX_BATCH_BYTES
        or hashes > MAX_HASHES_PER_BATCH
        or (with_tokens and tokens > MAX_TOKENS_PER_BATCH)
    )
    try:
        batch = decode_message(frames, with_tokens)
    except KvEventDecodeError as err:
        assert over and err.reason == "batch_too_heavy", (
            err
        )  # a valid batch within the bounds is never refused
    else:
        assert not over and sum(len(e.block_hashes) for e in batch.events) == hashes
    check([frames])


SLICE = 16  # kv_budget.CHUNK_HASHES in these examples: the same cuts, at a thousandth of the work


@st.composite
def heavy_drain(draw) -> tuple[KvEventDrain, int]:
    """A poll's drain of batches of any weight among drops, seqs in order from 0: (drain, messages)."""
    items, seq = [], 0
    for _ in range(draw(st.integers(0, 30))):
        if draw(st.integers(0, 4)) == 0:
            count = draw(st.integers(1, 5))
            items.append(Dropped(draw(st.sampled_from(DROP_REASONS)), seq, count))
            seq += count
        else:
            weight = draw(st.integers(0, 4) | st.sampled_from((SLICE - 1, SLICE, SLICE + 1, 2 * SLICE)))
            hashes = tuple(range(seq * 100, seq * 100 + weight))
            items.append(Batch(seq, 1.0, (Event("BlockStored", hashes),)))
            seq += 1
    return KvEventDrain(tuple(items)), seq


@FUZZ
@given(heavy_drain(), st.none() | st.floats(0, 50), st.lists(st.floats(0, 10), min_size=1, max_size=50))
def test_a_heavy_drain_under_any_budget_is_applied_or_dropped_never_missed(drain, budget, steps):
    drain, messages = drain
    times = iter(range(10**6))
    clock = lambda: sum(steps[: next(times) % len(steps)])  # noqa: E731 (any non-decreasing clock)
    part = PollState(retention=60).add_kv_events(EventState(max_blocks=10**6), attribution=Attribution())
    part.budget, part.clock = budget, clock
    with mock.patch.object(kv_budget, "CHUNK_HASHES", SLICE):
        part.ingest(drain, 1.0)
    events, totals = part.events, part.attribution.totals
    assert events.batches + sum(events.dropped.values()) == messages
    assert events.missed == 0
    assert totals.batches == events.batches
    if budget is None:
        assert events.dropped["budget_exceeded"] == sum(
            i.count for i in drain.items if isinstance(i, Dropped) and i.reason == "budget_exceeded"
        )


@st.composite
def size_fields(draw) -> tuple[list[bytes], int]:
    """A batch whose size fields say anything (issue 33 item 0: block_size 2^64 - 1 beside 16 token
    ids a block), with the tokens the events really carry."""
    events, carried = [], 0
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            events.append(
                {"type": "BlockRemoved", "block_hashes": draw(st.lists(st.integers(0, 15), max_size=4))}
            )
            continue
        hashes = draw(st.lists(st.integers(0, 15), max_size=8))
        tokens = draw(st.integers(0, 160))
        size = draw(st.integers(0, 64) | st.integers(0, 2**64 - 1) | st.sampled_from([2**16, 2**16 + 1]))
        parent = draw(st.none() | st.integers(0, 15))
        events.append(
            {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
             "token_ids": [draw(st.integers(0, 3))] * tokens, "block_size": size}
        )  # fmt: skip
        # what the event carries: its token ids; without any (an offload placeholder) a plausible size
        carried += tokens or (size * len(hashes) if size <= MAX_BLOCK_SIZE else 0)
    seq = draw(st.integers(0, 3)).to_bytes(8, "big")
    return [b"kv", seq, msgspec.msgpack.encode([1.0, events, 0])], carried


@FUZZ
@given(st.lists(size_fields(), min_size=1, max_size=6))
def test_size_fields_never_count_more_tokens_than_the_events_carry(messages):
    """Every token counter is bounded by the token ids the stream carried: an event whose size fields
    say more is refused (invalid_block_size), its batch kept."""
    part = KvEventsState(EventState(), {}, Attribution(), MissHistory(1e9), UnitView())
    carried = 0
    for frames, tokens in messages:
        try:
            batch = decode_message(frames, with_tokens=True)
        except KvEventDecodeError:
            continue
        carried += tokens
        part.ingest(KvEventDrain((batch,)), 0.0)
    units, totals = part.units.totals, part.attribution.totals
    assert units.stored_tokens + units.reused_tokens <= carried
    assert totals.prompt_miss_tokens + totals.decode_tokens <= carried
