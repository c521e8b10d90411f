"""The host-tier what-if against an exact two-tier LRU replay of the same requests.

The estimate reads only what a sidecar sees (the stream of the GPU cache alone plus vLLM's hit
counter); the analyzer's exact two-tier replay (analyzer/hosttier.py) re-runs the requests through vLLM's
block pool with a host LRU of H blocks that takes every block the GPU evicts and gives it back on a hit."""

import pytest

from kvcache_exporter.analyzer.hosttier import two_tier_replay
from kvcache_exporter.derive.attribution import Attribution
from kvcache_exporter.derive.whatif import host_tier_blocks, kv_bytes_per_token
from tests.derive.test_attribution_estimate import recurring_prefixes, run_engine


def estimated(requests, block_size: int, gpu_blocks: int, host_blocks: int) -> tuple[float, float]:
    """(real hit ratio at gpu_blocks, the host-tier estimate) from the engine's own KV events."""
    attribution = Attribution(capacity_blocks=gpu_blocks)
    attribution.set_host_tier(host_blocks, 1024.0)
    hits, queries = run_engine(requests, block_size, gpu_blocks, attribution)
    totals = attribution.totals
    assert totals.host_load_bytes == totals.host_hit_tokens * 1024.0
    return hits / queries, (hits + totals.host_hit_tokens) / queries


@pytest.mark.parametrize("gpu_blocks, host_blocks", [(64, 64), (64, 192), (128, 128)])
def test_host_tier_estimate_is_close_to_the_exact_two_tier_replay(gpu_blocks, host_blocks):
    requests = recurring_prefixes()
    real, estimate = estimated(requests, 16, gpu_blocks, host_blocks)
    exact = two_tier_replay(requests, 16, gpu_blocks, host_blocks).hit_ratio
    assert (
        abs(two_tier_replay(requests, 16, gpu_blocks, 0).hit_ratio - real) < 0.01
    )  # the oracle is vLLM's pool
    assert exact > real + 0.05  # the tier is worth something here: the test can tell
    assert exact - 0.06 < estimate <= exact + 0.01, (real, estimate, exact)


def test_the_tier_in_blocks_from_the_flag_or_what_vllm_reports():
    seed = {"kv_cache_memory_bytes": "3145728", "kv_cache_size_tokens": "3072", "block_size": "32"}
    assert kv_bytes_per_token(seed) == 1024.0  # 2 layers x 4 KV heads x 32 dims x (K, V) x 2 bytes
    assert host_tier_blocks(seed, 64 * 32 * 1024) == 64
    assert host_tier_blocks({**seed, "num_cpu_blocks": "500"}, None) == 500
    assert host_tier_blocks({**seed, "kv_offloading_size": "0.5"}, None) == (1 << 29) // (32 * 1024)
    assert host_tier_blocks(seed, None) is None  # no flag, no tier reported
    assert host_tier_blocks({"block_size": "32"}, 1 << 30) is None  # no KV layout: no size in blocks


def test_a_tier_of_no_blocks_hits_nothing():
    requests = recurring_prefixes()
    real, estimate = estimated(requests, 16, 64, 0)  # --whatif.host-tier-bytes 0
    assert estimate == real  # the evictions were there (the 64-block tier above is worth > 5 %)
    one_block_real, one_block = estimated(requests, 16, 64, 1)
    assert one_block >= one_block_real  # a one-block tier keeps a block only until the next eviction
