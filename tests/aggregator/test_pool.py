"""The aggregator against a simulated pool: real ZMQ streams and /metrics over loopback."""

import asyncio
import json
import os
import time

import pytest

from kvcache_exporter.aggregator.discovery import FileSd
from kvcache_exporter.aggregator.fleet_residency import FleetResidency, HashRange
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from kvcache_exporter.samples import Sample
from kvcache_exporter.simulator import EngineConfig, LatencyModel, SimulatorConfig
from kvcache_exporter.simulator.config import Faults
from kvcache_exporter.simulator.fleet import SimulatorFleet
from tests.conftest import free_port

FAST = LatencyModel(base_s=0.002, per_prefill_token_s=0.00001, per_decode_seq_s=0.0001)
REPLICAS = 4


def pool_config(**overrides) -> SimulatorConfig:
    base = {
        "engine": EngineConfig(block_size=16, num_gpu_blocks=1024, max_model_len=4096, latency=FAST),
        "schedule": "chat",
        "rate": 100.0,
        "concurrency": 16,
        "speed": 10.0,
    }
    return SimulatorConfig(**{**base, **overrides})


def values(samples, name):
    return {tuple(sorted(s.labels.items())): s.value for s in samples if s.name == name}


def total(samples, name, **labels):
    return sum(v for key, v in values(samples, name).items() if set(labels.items()) <= set(key))


async def run_pool(tmp_path, routing, seconds=3.0, during=None, sim=None, setup=None):
    """Run a 4-replica chat pool and an aggregator on it for `seconds`; its last samples."""
    path = str(tmp_path / "pool.json")
    fleet = await SimulatorFleet(sim or pool_config(), REPLICAS, routing, path).start(load=False)
    aggregator = Aggregator(PoolSettings(windows=(600.0,), interval=0.5), [FileSd(path, None)])
    if setup is not None:
        setup(aggregator)
    try:
        await aggregator.poll_once()  # subscribe to every replica, then send load
        await asyncio.sleep(0.3)
        fleet.start_load()
        started = time.monotonic()
        while time.monotonic() - started < seconds:
            await aggregator.poll_once()
            if during is not None and time.monotonic() - started > seconds / 2:
                await during(fleet)
                during = None
            await asyncio.sleep(0.4)
        await fleet.stop_load()  # poll until every stream has gone quiet
        seen = None
        for _ in range(20):
            await asyncio.sleep(0.3)
            await aggregator.poll_once()
            now = values(aggregator.latest, "kvcache_fleet_stored_tokens_total")
            if now == seen:
                break
            seen = now
        return aggregator.latest
    finally:
        await aggregator.close()
        await fleet.stop()


def share(samples):
    other = total(samples, "kvcache_prefix_cache_miss_tokens_total", cause="other_replica")
    return other / total(samples, "kvcache_fleet_stored_tokens_total")


def ratios(samples):
    real = values(samples, "kvcache_fleet_hit_ratio")[(("window", "10m"),)]
    estimate = values(samples, "kvcache_fleet_hit_ratio_estimate")[
        (("routing", "prefix_affinity"), ("window", "10m"))
    ]
    return real, estimate


@pytest.mark.timeout(60)
def test_round_robin_chat_misses_what_other_replicas_hold(tmp_path):
    samples = asyncio.run(run_pool(tmp_path, "round-robin"))
    real, estimate = ratios(samples)
    assert share(samples) > 0.4  # most computed blocks were resident on another replica
    assert estimate > real + 0.15
    assert values(samples, "kvcache_fleet_duplicate_blocks_ratio")[()] > 0.3
    assert set(values(samples, "kvcache_vllm_up").values()) == {1.0}
    assert len(values(samples, "kvcache_fleet_stored_tokens_total")) == REPLICAS
    assert not values(samples, "kvcache_fleet_sessions_split_ratio")  # no session ids: absent


@pytest.mark.timeout(60)
def test_session_routing_leaves_almost_nothing_to_gain(tmp_path):
    samples = asyncio.run(run_pool(tmp_path, "session"))
    real, estimate = ratios(samples)
    assert share(samples) < 0.05  # only the shared system block, computed once per replica
    assert estimate == pytest.approx(real, abs=0.02)
    assert 0 <= real <= estimate <= 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("routing", ["round-robin", "session"])
def test_session_ids_show_which_sessions_the_router_split(tmp_path, routing):
    """Ground truth from BlockStored's session_id: round-robin spreads a chat session's turns over
    the replicas, session routing keeps each on one."""
    samples = asyncio.run(run_pool(tmp_path, routing, sim=pool_config(session_ids=True)))
    sessions = values(samples, "kvcache_fleet_sessions")[()]
    split = values(samples, "kvcache_fleet_sessions_split")[()]
    ratio = values(samples, "kvcache_fleet_sessions_split_ratio")[()]
    assert sessions >= 8 and ratio == split / sessions
    real, estimate = ratios(samples)
    print(f"{routing}: {sessions:.0f} sessions, split ratio {ratio:.2f}; hit {real:.2f} est {estimate:.2f}")
    if routing == "round-robin":
        assert ratio > 0.5 and estimate > real + 0.15
    else:
        assert split == 0 and estimate == pytest.approx(real, abs=0.02)


@pytest.mark.timeout(60)
def test_shards_of_a_live_pool_sum_to_the_whole(tmp_path):
    """Every batch the aggregator ingests from the live pool also goes to two half-range shards (so
    all three see the very same stream): the shards' counts add up to the whole's exactly."""
    halves = [FleetResidency(HashRange(1.0, k, 2)) for k in range(2)]

    def tee(aggregator):
        ingest = aggregator.ingest

        def both(name, batch, rank=0):
            ingest(name, batch, rank)
            for half in halves:
                half.apply(name, batch, rank)

        aggregator.ingest = both

    samples = asyncio.run(run_pool(tmp_path, "round-robin", setup=tee))
    stored = values(samples, "kvcache_fleet_stored_tokens_total")
    other = values(samples, "kvcache_prefix_cache_miss_tokens_total")
    assert len(stored) == REPLICAS and sum(other.values()) > 0
    for name in (f"replica-{i}" for i in range(REPLICAS)):
        parts = [half.replicas[name] for half in halves]
        assert sum(p.stored for p in parts) * 16 == stored[(("replica", name),)]
        assert (
            sum(p.other_replica for p in parts) * 16 == other[(("cause", "other_replica"), ("replica", name))]
        )
    assert sum(h.duplicates for h in halves) == values(samples, "kvcache_fleet_duplicate_blocks")[()]
    assert sum(h.distinct for h in halves) == values(samples, "kvcache_fleet_distinct_blocks")[()]


@pytest.mark.timeout(60)
def test_a_replica_restart_and_lost_batches_are_seen_per_replica(tmp_path):
    sim = pool_config(faults=Faults(drop_kv_seq_every=7))
    samples = asyncio.run(
        run_pool(tmp_path, "round-robin", seconds=4.0, during=lambda f: f.restart(1), sim=sim)
    )
    restarts = values(samples, "kvcache_fleet_replica_restarts_total")
    assert restarts[(("replica", "replica-1"),)] == 1
    assert sum(restarts.values()) == 1
    missed = values(samples, "kvcache_kv_events_missed_batches_total")
    assert all(n > 0 for n in missed.values()) and len(missed) == REPLICAS
    assert set(values(samples, "kvcache_vllm_up").values()) == {1.0}
    real, estimate = ratios(samples)
    assert 0 <= real <= estimate <= 1


def test_bad_discovery_keeps_the_last_good_replicas_and_a_dead_replica_reads_down(tmp_path):
    """No simulator: one replica whose port nobody listens on, then a file_sd broken mid-run."""
    path = tmp_path / "pool.json"
    path.write_text(f'[{{"targets": ["127.0.0.1:{free_port()}"], "labels": {{"replica": "gone"}}}}]')
    aggregator = Aggregator(PoolSettings(windows=(60.0,), timeout=1.0), [FileSd(str(path), None)])

    async def body():
        await aggregator.poll_once()
        path.write_text("[{")
        os.utime(path, ns=(1, 1))
        await aggregator.poll_once()
        await aggregator.close()
        return aggregator.latest

    samples = asyncio.run(body())
    assert values(samples, "kvcache_vllm_up") == {(("replica", "gone"),): 0.0}
    assert values(samples, "kvcache_fleet_replicas")[()] == 1  # the last good list still stands
    discovery = (("collector", "discovery_file_sd"),)
    assert values(samples, "kvcache_exporter_collector_success")[discovery] == 0.0
    assert values(samples, "kvcache_exporter_errors_total")[(*discovery, ("reason", "parse_error"))] == 1
    vllm_errors = {
        k: v for k, v in values(samples, "kvcache_exporter_errors_total").items() if ("replica", "gone") in k
    }
    assert sum(vllm_errors.values()) == 2  # one failed poll of /metrics per poll, with its reason
    assert not values(samples, "kvcache_fleet_hit_ratio")  # no data: no ratio, never a made-up 0


def test_a_failing_poll_is_counted_and_the_loop_goes_on(tmp_path):
    aggregator = Aggregator(PoolSettings(windows=(60.0,), interval=0.05), [])
    real_poll, polls = aggregator.engine.poll_once, []

    async def broken_three_times():
        polls.append(1)
        if len(polls) <= 3:
            raise ZeroDivisionError("a bug")
        await real_poll()  # the fourth poll exports what the loop counted
        stop.set()

    aggregator.engine.poll_once = broken_three_times  # the loop, not the poll, is under test
    stop = asyncio.Event()
    asyncio.run(aggregator.run(stop))
    assert values(aggregator.latest, "kvcache_exporter_errors_total") == {
        (("collector", "derive"), ("reason", "internal_error")): 3
    }


def test_values_outside_their_range_never_reach_metrics():
    aggregator = Aggregator(PoolSettings(), [])
    bad = [
        Sample("kvcache_fleet_duplicate_blocks_ratio", {}, 1.5),
        Sample("kvcache_fleet_replicas", {}, -1.0),
    ]
    assert aggregator.engine.guard.filter(bad) == []
    assert aggregator.engine.guard.errors["invalid_value"] == 2


def test_replicas_left_out_are_logged_once_per_change_not_every_interval(tmp_path, caplog):
    path = tmp_path / "pool.json"
    targets = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    path.write_text(json.dumps([{"targets": targets}]))
    aggregator = Aggregator(
        PoolSettings(windows=(60.0,), timeout=0.2, max_replicas=1), [FileSd(str(path), None)]
    )
    caplog.set_level("WARNING")

    async def body():
        for _ in range(5):
            await aggregator.poll_once()
        path.write_text(json.dumps([{"targets": targets[:2]}]))
        os.utime(path, ns=(1, 1))
        await aggregator.poll_once()

    asyncio.run(body())
    lines = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert lines == [
        "more replicas than --replica.max: 2 left out",
        "more replicas than --replica.max: 1 left out",
    ]
    assert aggregator.left_out == 1
