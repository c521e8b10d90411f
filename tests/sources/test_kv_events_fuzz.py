"""Property tests of the KV-event decoder and EventState, seeded from the real vLLM 0.32 frames.

The contract (issue 14): no exception but KvEventDecodeError leaves the decoder, none at all
leaves the state, every exported value is finite and non-negative, the tracked set stays within
its bound. `make fuzz` runs the same properties with FUZZ_EXAMPLES=100000; an input that breaks
them is written to tests/fixtures/fuzz/kv-events/ and replayed here from then on.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcache_exporter.derive.kv_events import EventState, kv_event_samples
from kvcache_exporter.sources.kv_events_decode import KvEventDecodeError, decode_message

from .conftest import load_seed_kv_frames

REGRESSIONS = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz" / "kv-events"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "1000"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=EXAMPLES < 10_000,  # CI replays the same cases; `make fuzz` explores
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
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
