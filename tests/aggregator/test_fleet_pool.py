from kvcache_exporter.aggregator import fleet_pool
from kvcache_exporter.aggregator.fleet_residency import FleetResidency, HashRange
from kvcache_exporter.derive.windows import Delta
from kvcache_exporter.sources.kv_events_decode import Batch, Event
from kvcache_exporter.sources.vllm import EngineSample, VllmSnapshot


def delta(**counters):
    return Delta(60.0, counters, {})


def test_the_estimate_adds_other_replica_tokens_to_the_hits_and_stays_a_ratio():
    pool = fleet_pool.pool_window(
        [
            (delta(hit_tokens=30, query_tokens=100), delta(other_replica_blocks=2), 16),
            (delta(hit_tokens=10, query_tokens=100), delta(other_replica_blocks=1), 16),
            (delta(hit_tokens=99, query_tokens=99), None, 16),  # no fleet history yet: left out
            (delta(hit_tokens=99, query_tokens=99), delta(other_replica_blocks=1), None),  # no block size
        ]
    )
    assert (pool.real, pool.estimate) == (0.2, (40 + 48) / 200)
    capped = fleet_pool.pool_window(
        [(delta(hit_tokens=90, query_tokens=100), delta(other_replica_blocks=4), 16)]
    )
    assert capped.estimate == 1.0
    assert (
        fleet_pool.pool_window([]).real is None
        and fleet_pool.window_samples("5m", fleet_pool.pool_window([])) == []
    )


def test_a_shard_stretches_its_slice_to_the_whole_space():
    window = [(delta(hit_tokens=0, query_tokens=1000), delta(other_replica_blocks=5), 16)]
    assert fleet_pool.pool_window(window, slice_scale=4).estimate == 5 * 16 * 4 / 1000


def test_replica_counters_sum_engines_and_block_size_comes_from_cache_config():
    engines = {
        ("m", "0"): EngineSample({"query_tokens": 10, "hit_tokens": 4}, start_time=5.0),
        ("m", "1"): EngineSample({"query_tokens": 6}, start_time=3.0),
    }
    snapshot = VllmSnapshot(
        engines, {"0": {"block_size": "32"}, "1": {"block_size": "None"}}, "v1", "vllm:", (), ()
    )
    counters = fleet_pool.replica_counters(snapshot)
    assert counters.counters == {"query_tokens": 16, "hit_tokens": 4} and counters.start_time == 3.0
    assert fleet_pool.block_size(snapshot) == 32
    assert fleet_pool.block_size(VllmSnapshot({}, {}, "v1", "vllm:", (), ())) is None


def test_token_counters_wait_for_the_block_size_and_everything_is_scaled():
    fleet = FleetResidency(HashRange(sampling=0.5))
    fleet.apply("a", Batch(0, 0.0, (Event("BlockStored", (1, 2)),)))
    fleet.apply("b", Batch(0, 0.0, (Event("BlockStored", (1, 2)),)))
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in fleet_pool.residency_samples(fleet, {"a": 16})
    }
    assert samples[("kvcache_fleet_hash_sampling_ratio", ())] == 0.5
    assert samples[("kvcache_fleet_stored_tokens_total", (("replica", "a"),))] == 2 * 16 * 2
    assert ("kvcache_fleet_stored_tokens_total", (("replica", "b"),)) not in samples
    assert (
        samples[("kvcache_prefix_cache_miss_tokens_total", (("cause", "other_replica"), ("replica", "a")))]
        == 0
    )
    assert (
        samples[("kvcache_fleet_duplicate_blocks", ())] == samples[("kvcache_fleet_distinct_blocks", ())] == 4
    )
    assert samples[("kvcache_fleet_duplicate_blocks_ratio", ())] == 1.0
