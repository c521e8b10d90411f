"""Property tests of miss attribution across polls, fed the real vLLM 0.32 frames mutated.

The contract (issue 14) for the attribution state: no exception leaves it, whatever the decoder
let through; every sample it exports passes the guard (finite, within its catalog range: no
negative count, no ratio outside [0, 1]); its counters never go down from one poll to the next;
the tracked hashes and fingerprints stay within their bounds. `make fuzz` runs the same properties
with FUZZ_EXAMPLES=100000; an input that breaks them is written to
tests/fixtures/fuzz/attribution/ and replayed here from then on.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.miss_windows import MissHistory, miss_samples
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.windows import Delta
from kvcache_exporter.guard import problem
from kvcache_exporter.sources.kv_events_decode import (
    Dropped,
    KvEventDecodeError,
    KvEventDrain,
    decode_message,
)
from tests.fuzzing import fuzz_settings
from tests.sources.conftest import load_seed_kv_frames

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "fuzz"
REGRESSIONS = FIXTURES / "attribution"
DECODER_REGRESSIONS = FIXTURES / "kv-events"  # the decoder's kept poisons: one poll each
FUZZ = fuzz_settings(500)
REAL = load_seed_kv_frames()
MAX_BLOCKS, MAX_FINGERPRINTS = 64, 256
WINDOWS = [(5.0, "5s"), (60.0, "1m")]


def drain(messages: list[list[bytes]]) -> KvEventDrain:
    """What the subscriber hands a poll: decoded batches, and a Dropped for each bad message."""
    items = []
    for frames in messages:
        try:
            items.append(decode_message(frames, with_tokens=True))
        except KvEventDecodeError as err:
            items.append(Dropped(err.reason, err.seq))
    return KvEventDrain(tuple(items))


def check(polls: list[list[list[bytes]]], vllm: tuple[float, float]) -> None:
    attribution = Attribution(max_blocks=MAX_BLOCKS, max_fingerprints=MAX_FINGERPRINTS, capacity_blocks=32)
    state = KvEventsState(attribution=attribution, misses=MissHistory(retention=120.0))
    queries, hits = vllm
    window = Delta(5.0, {"query_tokens": queries, "hit_tokens": hits}, {})
    before: dict[tuple, float] = {}
    try:
        for number, messages in enumerate(polls):
            state.ingest(drain(messages), ts=float(number))
            samples = miss_samples(attribution.totals, state.misses, WINDOWS, lambda _seconds: window)
            for sample in samples:
                assert problem(sample) is None, sample
                key = (sample.name, tuple(sorted(sample.labels.items())))
                if "ratio" not in sample.name:  # counters and histogram parts only grow
                    assert sample.value >= before.get(key, 0.0), sample
                    before[key] = sample.value
            tracked_hashes, tracked_fingerprints = attribution.tracked
            assert tracked_hashes <= MAX_BLOCKS and tracked_fingerprints <= MAX_FINGERPRINTS
    except BaseException:
        if os.environ.get("FUZZ_SAVE"):
            keep(polls, vllm)
        raise


def keep(polls: list[list[list[bytes]]], vllm: tuple[float, float]) -> None:
    blob = msgspec.msgpack.encode({"polls": polls, "vllm": list(vllm)})
    REGRESSIONS.mkdir(parents=True, exist_ok=True)
    (REGRESSIONS / f"{hashlib.sha256(blob).hexdigest()[:16]}.msgpack").write_bytes(blob)


real_message = st.sampled_from(REAL)


@st.composite
def mutated(draw) -> list[bytes]:
    """A real message, kept as it is or with bytes flipped, cut, inserted or spliced, or a new seq."""
    topic, seq, payload = draw(real_message)
    data = bytearray(payload)
    for _ in range(draw(st.integers(0, 4))):
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
            data[at:] = other[draw(st.integers(0, len(other) - 1)) :]
        else:
            seq = draw(st.sampled_from((0, 1, 2**32, 2**63, 2**64 - 1))).to_bytes(8, "big")
    return [topic, seq, bytes(data)]


polls = st.lists(st.lists(mutated(), max_size=6), min_size=1, max_size=5)
counts = st.floats(0, 1e12, allow_nan=False)
vllm_window = st.tuples(counts, counts)  # hits may exceed queries: two counters scraped apart


@FUZZ
@given(polls, vllm_window)
def test_mutated_real_streams_keep_the_contract(stream, vllm):
    check(stream, vllm)


def test_the_real_stream_in_order_is_attributed():
    """The unmutated seed run, a poll per 50 messages: the property's baseline is not vacuous."""
    attribution = Attribution(max_blocks=MAX_BLOCKS, max_fingerprints=MAX_FINGERPRINTS)
    polls_of_real = [REAL[i : i + 50] for i in range(0, len(REAL), 50)]
    check(polls_of_real, (1e6, 5e5))
    state = KvEventsState(attribution=attribution, misses=MissHistory(retention=120.0))
    for number, messages in enumerate(polls_of_real):
        state.ingest(drain(messages), ts=float(number))
    assert attribution.totals.batches == len(REAL) and attribution.totals.prompt_miss_tokens > 0


def _kept() -> list[Path]:
    return sorted(REGRESSIONS.glob("*.msgpack")) + sorted(DECODER_REGRESSIONS.glob("*.msgpack"))


@pytest.mark.parametrize("path", _kept(), ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_kept_regressions_keep_the_contract(path):
    kept = msgspec.msgpack.decode(path.read_bytes())
    if path.parent == DECODER_REGRESSIONS:  # a list of messages, and the real stream after it
        kept = {"polls": [kept, REAL[:20]], "vllm": [1e6, 5e5]}
    check([[list(m) for m in poll] for poll in kept["polls"]], tuple(kept["vllm"]))
