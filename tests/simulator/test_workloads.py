import json
import random

import pytest

from kvcache_exporter.simulator.dcgm import GpuState
from kvcache_exporter.simulator.workloads import (
    USER_LABEL,
    CustomerServiceCorpus,
    MultiTurnChat,
    WorkloadFactory,
    parse_schedule,
    phase_at,
    trace_lines,
)


def test_schedule_parsing_and_phases():
    phases = parse_schedule("normalized:60s,raw:1m,normalized")
    assert phases == [("normalized", 60.0), ("raw", 60.0), ("normalized", None)]
    assert [phase_at(phases, t) for t in (0, 59.9, 60, 119, 500)] == [
        "normalized",
        "normalized",
        "raw",
        "raw",
        "normalized",
    ]
    with pytest.raises(ValueError):
        parse_schedule("rawx:10s")


def test_seed_layouts():
    factory = WorkloadFactory(seed=1, max_tokens=8)
    raw, normalized = factory.make("raw").next_request(), factory.make("normalized").next_request()
    assert raw.prompt_token_ids[0] == 7  # header first
    assert normalized.prompt_token_ids[-1] != 7 and 7 in normalized.prompt_token_ids[200:]
    assert raw.prompt_token_ids[-60:] != normalized.prompt_token_ids[:200]


def test_chat_sessions_grow_with_the_answers():
    chat = MultiTurnChat(CustomerServiceCorpus(1), random.Random(2), max_tokens=32, sessions=1)
    first = chat.next_request()
    chat.on_response(first, [42, 43])
    second = chat.next_request()
    assert second.session == first.session
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + 2] == [*first.prompt_token_ids, 42, 43]


def test_trace_replay_keeps_gaps_and_outputs(seed_dir):
    trace = WorkloadFactory(seed=1, trace_path=str(seed_dir / "trace.jsonl")).make("trace")
    first, second = trace.next_request(), trace.next_request()
    assert first.max_tokens == 8 and len(first.forced_output) == 8
    assert first.gap_s == 0 and second.gap_s > 0


def test_memory_swing_moves_between_12_and_20_gb():
    gpu = GpuState(0, 81559, 70000, swing_period_s=60)
    used = []
    for _ in range(60):
        gpu.advance(1.0, 0.5, 0.1)
        used.append(gpu.values()["DCGM_FI_DEV_FB_USED"])
    assert 11400 <= min(used) < 11500 and 19000 < max(used) <= 19074
    assert gpu.values()["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"] > 0


def test_trace_workload_loops_and_keeps_null_sessions_apart(tmp_path):
    lines = [
        {"i": 0, "send_ts": 10.0, "prompt_token_ids": [1, 2, 3], "session": None},
        {"i": 1, "send_ts": 10.5, "prompt_token_ids": [4, 5], "session": "alice"},
        {"i": 2, "send_ts": 11.5, "prompt_token_ids": [6], "max_tokens": 4},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    workload = WorkloadFactory(seed=1, trace_path=str(path)).make("trace")
    specs = [workload.next_request() for _ in range(3 * len(lines) + 1)]  # three loops and a bit
    assert [s.prompt_token_ids for s in specs] == [[1, 2, 3], [4, 5], [6]] * 3 + [[1, 2, 3]]
    assert [s.gap_s for s in specs[:4]] == [0.0, 0.5, 1.0, 0.0]
    assert specs[0].session == "trace-0" and specs[1].session == "alice" and specs[2].session == "trace-2"
    assert "None" not in {s.session for s in specs}


def test_trace_lines_write_each_phase_as_analyze_reads_it():
    lines = list(trace_lines(WorkloadFactory(7), "normalized:30s,chat,none,raw", per_phase=20))
    assert [line["i"] for line in lines] == list(range(60))
    assert [line["phase"] for line in lines] == ["normalized"] * 20 + ["chat"] * 20 + ["raw"] * 20
    raw, normalized = lines[40], lines[0]
    assert raw["prompt_token_ids"][0] == USER_LABEL and normalized["prompt_token_ids"][0] != USER_LABEL
    chat = [line for line in lines if line["phase"] == "chat"]
    first = {}
    for line in chat:
        earlier = first.setdefault(line["session"], line["prompt_token_ids"])
        assert line["prompt_token_ids"][: len(earlier)] == earlier  # a later turn carries the earlier ones
    assert len(first) == 16  # 16 sessions, then turns of them
    again = list(trace_lines(WorkloadFactory(7), "normalized:30s,chat,none,raw", per_phase=20))
    assert again == lines  # the seed decides
