"""Property tests of SGLang's and TensorRT-LLM's streams (sources/engine_events.py), seeded from the
real SGLang 0.5.23 captures: both event encodings mixed in one batch (0.5.23's tagged maps, 0.5.5's
tagged arrays), unknown media, pages of 0 or 10^9 tokens, merged events whose token count and hashes
disagree, TensorRT-LLM's string token ids and multimodal keys.

The contract: only KvEventDecodeError leaves the decoder; each event is either kept or refused
(`invalid_event`, `invalid_block_size`), exactly as the engine's rules say (the oracle below states
them independently); what is kept obeys them; attribution and the event view stay finite and
non-negative. `make fuzz` runs them with FUZZ_EXAMPLES=100000."""

from __future__ import annotations

import json
import math

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.kv_events import EventState, kv_event_samples
from kvcache_exporter.derive.miss_windows import MissHistory
from kvcache_exporter.derive.state import KvEventsState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import MAX_BLOCK_SIZE, KvEventDecodeError, KvEventDrain
from tests.conftest import SHARED_FIXTURES
from tests.fuzzing import fuzz_settings

FUZZ = fuzz_settings(150)
SGLANG_MEDIA = ("GPU", "CPU_PINNED", "DISK", "EXTERNAL")
REAL = [
    [b"kv", m["seq"].to_bytes(8, "big"), bytes.fromhex(m["payload_hex"])]
    for name in ("live-kv-frames.json", "live-hicache-kv-frames.json")
    for m in json.loads((SHARED_FIXTURES / "sglang-0.5.23" / name).read_text())
]


@st.composite
def stored(draw, engine: str) -> tuple[object, str | None]:
    """One BlockStored in either encoding and what the engine's rules make of it (the oracle)."""
    pages = draw(st.integers(0, 6))
    size = draw(st.sampled_from((0, 1, 4, 16, 10**9)) | st.integers(0, 300))
    delta = draw(st.sampled_from((0, 0, 0, -1, 1, 5)) | st.integers(-64, 64))
    count = max(0, min(pages * size, 4096) + delta)
    medium = draw(st.sampled_from((*SGLANG_MEDIA, "CPU", "TAPE", None)))
    hashes = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=pages, max_size=pages))
    tokens: list = draw(st.lists(st.integers(0, 2**31 - 1), min_size=count, max_size=count))
    if engine == "trtllm" and tokens and draw(st.booleans()):
        tokens[0] = "<image>"  # TensorRT-LLM's EventTokenId is int | str
    salt, session = draw(st.sampled_from((None, "t"))), draw(st.sampled_from((None, "s")))
    held = size * pages
    if size and (size > MAX_BLOCK_SIZE or 0 < count < held):  # the shared decoder's bound
        expected = "invalid_block_size"
    elif medium is not None and medium not in (SGLANG_MEDIA if engine == "sglang" else ("GPU",)):
        expected = "invalid_event"
    elif pages and engine == "sglang" and (not size or count != held):  # SGLang's merged pages
        expected = "invalid_block_size"
    else:
        expected = None
    if draw(st.booleans()):  # SGLang 0.5.23 / TensorRT-LLM: a tagged map, omit_defaults
        event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None}
        event |= {"token_ids": tokens, "block_size": size, "lora_id": None}
        event |= {k: v for k, v in (("medium", medium), ("cache_salt", salt), ("session_id", session)) if v}
        if engine == "trtllm" and draw(st.booleans()):
            event["mm_keys"] = [[{"type": "mm_key", "hash": "ab" * 16, "start_offset": 0}] for _ in hashes]
    else:  # SGLang 0.5.5: a tagged array
        event = ["BlockStored", hashes, None, tokens, size, None, medium]
    return event, expected


@st.composite
def other_event(draw, engine: str) -> tuple[object, str | None]:
    medium = draw(st.sampled_from((*SGLANG_MEDIA, "CPU", None)))
    hashes = draw(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=4))
    bad = medium is not None and medium not in (SGLANG_MEDIA if engine == "sglang" else ("GPU",))
    kind = draw(st.sampled_from(("removed", "removed_array", "cleared", "cleared_array")))
    if kind == "removed":
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": medium,
        }, "invalid_event" if bad else None
    if kind == "removed_array":
        return ["BlockRemoved", hashes, medium], "invalid_event" if bad else None
    return ({"type": "AllBlocksCleared"} if kind == "cleared" else ["AllBlocksCleared"]), None


@st.composite
def message(draw, engine: str) -> tuple[list[bytes], list[str | None]]:
    events = draw(st.lists(stored(engine) | other_event(engine), max_size=6))
    seq = draw(st.integers(0, 50)).to_bytes(8, "big")
    payload = msgspec.msgpack.encode([1.0, [e for e, _ in events], 0])
    return [b"kv", seq, payload], [expected for _, expected in events]


def fold(messages: list[list[bytes]], engine: str) -> None:
    state = KvEventsState(
        EventState(max_blocks=64), {}, Attribution(), MissHistory(1e9), UnitView(64, sessions_compute=True)
    )
    for frames in messages:
        try:
            batch = decode_engine_message(frames, True, engine)
        except KvEventDecodeError as err:
            state.events.drop(err.reason, err.seq)
            continue
        state.ingest(KvEventDrain((batch,)), 1.0)
    for sample in kv_event_samples(state.events):
        assert math.isfinite(sample.value) and sample.value >= 0, sample
    totals = state.attribution.totals
    assert all(v >= 0 for v in totals.tokens.values()) and totals.tier_restored_tokens >= 0


def check_rules(frames: list[bytes], expected: list[str | None], engine: str) -> None:
    batch = decode_engine_message(frames, True, engine)
    # the shared decoder's refusals come first, then the engine's: compared as counts
    assert sorted(batch.refused) == sorted(e for e in expected if e), batch.problem
    assert len(batch.events) == sum(1 for e in expected if e is None)
    for event in batch.events:
        if engine == "sglang" and event.type == "BlockStored" and event.block_hashes:
            assert event.block_size >= 1
            assert event.token_count == event.block_size * len(event.block_hashes)
        if event.medium is not None:
            assert event.medium in (SGLANG_MEDIA if engine == "sglang" else ("GPU",))


@FUZZ
@given(st.lists(message("sglang"), min_size=1, max_size=5))
def test_sglang_streams_of_both_encodings_keep_the_rules_and_the_contract(messages):
    for frames, expected in messages:
        check_rules(frames, expected, "sglang")
    fold([frames for frames, _ in messages], "sglang")


@FUZZ
@given(st.lists(message("trtllm"), min_size=1, max_size=5))
def test_trtllm_streams_keep_the_rules_and_the_contract(messages):
    for frames, expected in messages:
        check_rules(frames, expected, "trtllm")
    fold([frames for frames, _ in messages], "trtllm")


@st.composite
def mutated_real(draw) -> list[bytes]:
    topic, seq, payload = draw(st.sampled_from(REAL))
    data = bytearray(payload)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        if draw(st.booleans()):
            data[at] ^= 1 << draw(st.integers(0, 7))
        else:
            del data[at:]
            if not data:
                break
    return [topic, seq, bytes(data)]


@FUZZ
@given(
    st.lists(mutated_real() | st.sampled_from(REAL), min_size=1, max_size=8),
    st.sampled_from(("sglang", "trtllm")),
)
def test_mutated_real_sglang_frames_keep_the_contract(messages, engine):
    fold(messages, engine)
