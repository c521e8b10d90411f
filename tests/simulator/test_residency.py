"""vLLM's --kv-cache-metrics residency histograms in the simulator: the real capture's shape, vLLM's
definitions (lifetime from allocation, idle from the last access, gaps between the last 4 accesses)."""

import random

from prometheus_client import generate_latest

from kvcache_exporter.simulator.config import SimulatorConfig, cache_config_labels
from kvcache_exporter.simulator.engine import Engine, EngineConfig, Request
from kvcache_exporter.simulator.exposition import ExpositionState, make_registry
from kvcache_exporter.simulator.residency import RESIDENCY_HISTOGRAMS
from tests.simulator.test_exposition import shape

FAMILIES = [f"vllm:{name}" for name in RESIDENCY_HISTOGRAMS]


def engine(num_gpu_blocks: int, sample: float) -> Engine:
    config = EngineConfig(block_size=16, num_gpu_blocks=num_gpu_blocks, kv_cache_metrics_sample=sample)
    return Engine(config)


def run_users(e: Engine, users: int, requests: int, seed: int = 1) -> None:
    """One request every 50 ms, a random user's 256-token prefix + 16 own tokens, 32 generated."""
    rnd = random.Random(seed)
    prefixes = [[5 + (u * 7919 + i * 31) % 490 for i in range(256)] for u in range(users)]
    now, sent = 0.0, 0
    while sent < requests or e.has_work:
        while sent < requests and sent * 0.05 <= now:
            prompt = prefixes[rnd.randrange(users)] + [5 + rnd.randrange(490) for _ in range(16)]
            e.add_request(Request(f"r{sent}", prompt, 32, now))
            sent += 1
        now += max(e.step(now).duration, 0.001)


def text(e: Engine) -> str:
    config = SimulatorConfig(engine=e.config)
    state = ExpositionState("tiny-llama", [e], 1.0, lambda i: cache_config_labels(config, i))
    return generate_latest(make_registry(lambda: state)).decode()


def test_families_match_the_real_capture(real_metrics_text):
    e = engine(256, 1.0)
    run_users(e, users=40, requests=100)
    real, ours = shape(real_metrics_text), shape(text(e))
    for name in FAMILIES:
        assert ours[name] == real[name], name


def test_off_by_default_like_vllm():
    e = Engine(EngineConfig(block_size=16, num_gpu_blocks=256))
    run_users(e, users=4, requests=20)
    assert not set(FAMILIES) & set(shape(text(e)))


def test_a_workload_that_fits_evicts_nothing():
    e = engine(2048, 1.0)
    for i in range(8):  # all admitted at once, 8 x 19 blocks of a 2047-block pool: nothing is reused
        e.add_request(Request(f"r{i}", [5 + (i * 37 + t) % 490 for t in range(272)], 32, 0.0))
    now = 0.0
    while e.has_work:
        now += e.step(now).duration
    assert all(e.stats.histograms[name].count == 0 for name in RESIDENCY_HISTOGRAMS)


def test_over_capacity_follows_vllms_definitions():
    e = engine(200, 1.0)  # 40 users' prefixes need 640 blocks
    run_users(e, users=40, requests=600)
    h = e.stats.histograms
    lifetime, idle, gaps = (h[name] for name in RESIDENCY_HISTOGRAMS)
    assert lifetime.count == idle.count > 0
    assert 0 < idle.total <= lifetime.total  # idle runs from the last access, lifetime from allocation
    assert 0 < gaps.count <= 3 * lifetime.count  # at most 3 gaps from vLLM's ring of 4 accesses


def test_sampling_follows_the_rate():
    full, sampled = engine(200, 1.0), engine(200, 0.1)
    run_users(full, users=40, requests=400)
    run_users(sampled, users=40, requests=400)
    ratio = (
        sampled.stats.histograms["kv_block_lifetime_seconds"].count
        / full.stats.histograms["kv_block_lifetime_seconds"].count
    )
    assert 0.05 < ratio < 0.2
