"""The fleet view on NATS JetStream (aggregator/nats_intake.py, fleet_publish.py) against a real
nats-server: sidecars' publishers fed with the real decoded batches of a live simulated pool, shards
reading their ranges through durable consumers, compared with the direct ZMQ fan-in."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from itertools import groupby
from operator import itemgetter

import pytest

from kvcache_exporter import fleet_wire as wire
from kvcache_exporter.aggregator.discovery import FileSd
from kvcache_exporter.aggregator.fleet_residency import FleetResidency, HashRange
from kvcache_exporter.aggregator.nats_intake import DeltaIntake, NatsIntake
from kvcache_exporter.aggregator.pool import Aggregator, PoolSettings
from kvcache_exporter.fleet_publish import FleetPublisher, NatsOptions
from kvcache_exporter.simulator import EngineConfig, LatencyModel, SimulatorConfig
from kvcache_exporter.simulator.fleet import SimulatorFleet
from kvcache_exporter.sources.kv_events_decode import Batch, Event, KvEventDrain
from tests.nats_server import NatsServer

FAST = LatencyModel(base_s=0.002, per_prefill_token_s=0.00001, per_decode_seq_s=0.0001)
REPLICAS = 4
POOL = "llama"


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "jetstream").start()
    yield server
    server.stop()


def pool_config() -> SimulatorConfig:
    return SimulatorConfig(
        engine=EngineConfig(block_size=16, num_gpu_blocks=1024, max_model_len=4096, latency=FAST),
        schedule="chat",
        rate=100.0,
        concurrency=16,
        speed=10.0,
        session_ids=True,
    )


def stored(hashes, session=None) -> Event:
    return Event("BlockStored", tuple(hashes), session_id=session)


def removed(hashes) -> Event:
    return Event("BlockRemoved", tuple(hashes))


def drain(*batches: Batch) -> KvEventDrain:
    return KvEventDrain(tuple(batches))


def spread(n: int, start: int = 0) -> list[int]:
    """n hashes spread over the whole 64-bit space (every range), as vLLM's sha256 hashes are."""
    return [((i + start) * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(n)]


def view(fleet: FleetResidency) -> dict:
    """What a fleet view says, order aside: per replica and for the pool."""
    replicas = {
        name: (v.resident, v.stored, v.other_replica, v.removed, v.overflow)
        for name, v in sorted(fleet.replicas.items())
    }
    return {"replicas": replicas, "distinct": fleet.distinct, "duplicates": fleet.duplicates}


def summed(views: list[dict]) -> dict:
    names = sorted({n for v in views for n in v["replicas"]})
    replicas = {
        n: tuple(sum(col) for col in zip(*(v["replicas"].get(n, (0,) * 5) for v in views), strict=True))
        for n in names
    }
    return {
        "replicas": replicas,
        "distinct": sum(v["distinct"] for v in views),
        "duplicates": sum(v["duplicates"] for v in views),
    }


def publisher(server: NatsServer, replica: str, **more) -> FleetPublisher:
    return FleetPublisher(NatsOptions(server.url), POOL, replica, **more)


def shard(server: NatsServer, k: int = 0, n: int = 1, sampling: float = 1.0) -> NatsIntake:
    fleet = FleetResidency(HashRange(sampling, k, n))
    return NatsIntake(NatsOptions(server.url), DeltaIntake(fleet, POOL), (k, n))


async def until(check: Callable[[], bool], seconds: float = 15.0) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("not reached in time")
        await asyncio.sleep(0.05)


async def settled(intake: NatsIntake, seconds: float = 15.0) -> None:
    """Until the shard has read everything the stream holds for it and applied nothing for a while."""
    await until(lambda: intake.connected_once, seconds)
    last, quiet = -1, 0
    deadline = time.monotonic() + seconds
    while quiet < 6 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        count = intake.intake.applied + sum(intake.intake.dropped.values())
        quiet = quiet + 1 if count == last and not any(intake.pending.values()) else 0
        last = count


@pytest.mark.timeout(60)
def test_deltas_reach_the_shard_that_owns_their_range_and_only_it(nats_server):
    async def run():
        a, b = publisher(nats_server, "a"), publisher(nats_server, "b")
        shards = [shard(nats_server, k, 2) for k in range(2)]
        whole = FleetResidency()
        for p in (a, b):
            p.start()
        batches = {
            "a": [Batch(0, 1.0, (stored(spread(40)),)), Batch(1, 2.0, (removed(spread(10)),))],
            "b": [Batch(7, 1.5, (stored(spread(30, 20), "s1"),))],
        }
        for name, p in (("a", a), ("b", b)):
            p.offer(0, drain(*batches[name]))
            assert await p.flush()
            for each in batches[name]:
                whole.apply(name, each)
        for s in shards:
            await s.start()
        try:
            for s in shards:
                await settled(s)
            halves = [view(s.intake.fleet) for s in shards]
            assert summed(halves) == view(whole)
            for s in shards:  # each shard holds only the hashes of its range
                lo, hi = s.intake.fleet.hash_range.bounds
                assert all(lo <= h < hi for h in s.intake.fleet._owners)
                assert s.intake.dropped == {}
            # one delta per range: the drain touched some, the new epoch's first drain reaches all
            assert len(wire.split(spread(40), 1 << 64)) < wire.RANGES
            assert a.published == wire.RANGES and a.dropped == {}
        finally:
            for each in (a, b, *shards):
                await each.close()

    asyncio.run(run())


async def live_pool(
    tmp_path, seconds: float = 3.0
) -> tuple[Aggregator, list[tuple[str, Batch]], SimulatorFleet]:
    """A 4-replica round-robin chat pool read by the direct ZMQ fan-in; every batch it applied, in
    its order (the caller closes both)."""
    path = str(tmp_path / "pool.json")
    sim = await SimulatorFleet(pool_config(), REPLICAS, "round-robin", path).start(load=False)
    direct = Aggregator(PoolSettings(windows=(600.0,), interval=0.5), [FileSd(path, None)])
    applied: list[tuple[str, Batch]] = []
    ingest = direct.ingest

    def tee(name: str, batch: Batch, rank: int = 0) -> None:
        ingest(name, batch, rank)
        applied.append((name, batch))

    direct.ingest = tee
    await direct.poll_once()  # subscribe to every replica, then send load
    await asyncio.sleep(0.3)
    sim.start_load()
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        await direct.poll_once()
        await asyncio.sleep(0.4)
    await sim.stop_load()
    seen = None
    for _ in range(20):  # until every stream has gone quiet
        await asyncio.sleep(0.3)
        await direct.poll_once()
        if len(applied) == seen:
            break
        seen = len(applied)
    return direct, applied, sim


async def publish_in_order(publishers: dict[str, FleetPublisher], applied: list[tuple[str, Batch]]) -> None:
    """The batches through each replica's publisher in the order the direct view applied them: a
    run of one replica's batches, then its flush, so the stream holds them in that order."""
    for name, run in groupby(applied, key=itemgetter(0)):
        publishers[name].offer(0, KvEventDrain(tuple(batch for _, batch in run)))
        assert await publishers[name].flush()


@pytest.mark.timeout(120)
def test_a_live_pool_reads_the_same_on_nats_as_direct_with_one_and_three_shards(nats_server, tmp_path):
    async def run():
        direct, applied, sim = await live_pool(tmp_path)
        publishers = {name: publisher(nats_server, name) for name in direct.fleet.replicas}
        one, three = shard(nats_server), [shard(nats_server, k, 3) for k in range(3)]
        try:
            for p in publishers.values():
                p.start()
            await publish_in_order(publishers, applied)
            for s in (one, *three):
                await s.start()
            for s in (one, *three):
                await settled(s)
            expected = view(direct.fleet)
            assert len(expected["replicas"]) == REPLICAS and expected["duplicates"] > 0
            assert sum(r[2] for r in expected["replicas"].values()) > 0  # other_replica misses
            assert view(one.intake.fleet) == expected
            assert summed([view(s.intake.fleet) for s in three]) == expected
            assert one.intake.fleet.sessions.counts() == direct.fleet.sessions.counts()
            for s in (one, *three):
                assert s.intake.dropped == {} and all(v.missed == 0 for v in s.intake.fleet.replicas.values())
            assert all(p.dropped == {} for p in publishers.values())
        finally:
            for each in (*publishers.values(), one, *three, direct):
                await each.close()
            await sim.stop()

    asyncio.run(run())


def batches_of(replica_seed: int, count: int, start_seq: int = 0) -> list[Batch]:
    """Stores with a removal now and then; replicas share part of their hashes (duplicates)."""
    out = []
    for i in range(count):
        seq = start_seq + i
        if i % 5 == 4:
            out.append(Batch(seq, float(seq), (removed(spread(3, 1000 * replica_seed + 7 * (i - 1))),)))
        else:
            shared = spread(4, 7 * i)  # the same on every replica
            own = spread(6, 1000 * replica_seed + 7 * i)
            out.append(Batch(seq, float(seq), (stored(shared + own),)))
    return out


async def taken_unacked(server: NatsServer, intake: NatsIntake, count: int) -> int:
    """A run of the shard killed between a fetch and its ack: `count` deltas delivered, never acked."""
    import nats

    nc = await nats.connect(server.url)
    try:
        sub = await nc.jetstream().pull_subscribe(intake.filters[0], intake.durable(0), intake.stream)
        return len(await sub.fetch(count, timeout=5))
    finally:
        await nc.close()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("first_run", [20, 0])
def test_a_restarted_shard_resumes_from_its_consumer_and_rebuilds_residency(nats_server, first_run):
    """The shard stops after the first `first_run` batches of the stream (0: before it acked any);
    the rest is published meanwhile, and the shard's consumer hands some of it out to a run killed
    before its ack (at any moment a live shard has a fetch out). Restarted, it reads the acked part
    again for its residency only and counts only what it had not: its residency is the whole
    stream's, its counts plus the first run's are the whole's, nothing missed."""

    async def run():
        pubs = {name: publisher(nats_server, name) for name in ("a", "b")}
        whole = FleetResidency()
        streams = {name: batches_of(i, 40) for i, name in enumerate(pubs)}
        for p in pubs.values():
            p.start()

        async def publish(part: slice) -> None:
            for name, p in pubs.items():
                if not streams[name][part]:
                    continue
                p.offer(0, drain(*streams[name][part]))
                assert await p.flush()
                for each in streams[name][part]:
                    whole.apply(name, each)

        first = shard(nats_server)
        await first.start()
        await publish(slice(0, first_run))
        await settled(first)
        before = view(first.intake.fleet)
        await first.close()
        await publish(slice(first_run, 40))
        assert await taken_unacked(nats_server, first, 5) == 5
        second = shard(nats_server)
        await second.start()
        try:
            await settled(second)
            after = view(second.intake.fleet)
            expected = view(whole)
            assert (second.rebuilt > 0) == (first_run > 0) and after["distinct"] == expected["distinct"]
            assert after["duplicates"] == expected["duplicates"]
            for name, counts in expected["replicas"].items():
                resident, *counted = counts
                assert after["replicas"][name][0] == resident
                first_counts = before["replicas"].get(name, (0,) * 5)[1:]
                now = after["replicas"][name][1:]
                assert [x + y for x, y in zip(first_counts, now, strict=True)] == counted
            assert all(v.missed == 0 and v.restarts == 0 for v in second.intake.fleet.replicas.values())
        finally:
            for each in (*pubs.values(), first, second):
                await each.close()

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_a_replica_restart_clears_its_residency_on_every_shard(nats_server):
    """vLLM restarts: its seq starts again at 0. The sidecar starts a new epoch; every shard forgets
    the replica's blocks once, as the direct view does."""

    async def run():
        a, b = publisher(nats_server, "a"), publisher(nats_server, "b")
        direct = FleetResidency()
        shards = [shard(nats_server, k, 2) for k in range(2)]
        for p in (a, b):
            p.start()
        sent = [("a", batches_of(0, 10)), ("b", batches_of(1, 10)), ("a", batches_of(2, 6, start_seq=0))]
        for name, batches in sent:
            p = a if name == "a" else b
            p.offer(0, drain(*batches))
            assert await p.flush()
            for each in batches:
                direct.apply(name, each)
        for s in shards:
            await s.start()
        try:
            for s in shards:
                await settled(s)
            assert summed([view(s.intake.fleet) for s in shards]) == view(direct)
            assert direct.replicas["a"].restarts == 1
            assert [s.intake.fleet.replicas["a"].restarts for s in shards] == [1, 1]
        finally:
            for each in (a, b, *shards):
                await each.close()

    asyncio.run(run())


def in_range(r: int, n: int = 3) -> list[int]:
    """n hashes of range r."""
    return [h for h in spread(4000) if wire.range_of(h, 1 << 64) == r][:n]


def raw_delta(replica="a", r=5, seq=0, epoch=1, pool=POOL, sampling=1.0, hashes=None, kind="vllm") -> bytes:
    change = wire.Change(True, in_range(r) if hashes is None else hashes)
    return wire.encode(
        wire.Delta(wire.VERSION, pool, replica, 0, r, epoch, 0, seq, sampling, 1.0, [change], kind)
    )


@pytest.mark.timeout(60)
def test_hostile_deltas_are_counted_and_dropped_and_the_rest_applied(nats_server):
    import msgspec
    import nats

    from kvcache_exporter.fleet_publish import ensure_stream

    subject = wire.delta_subject("kvcache", POOL, 5, "a")
    sends = [
        (subject, b"\xc1\xff\x00", "parse_error"),
        (
            subject,
            msgspec.msgpack.encode([2, POOL, "a", 0, 5, 1, 0, 0, 1.0, 1.0, []]),
            "parse_error",
        ),  # version
        (subject, msgspec.msgpack.encode([1, POOL, "a", 0, 5, 1, 0, -1, 1.0, 1.0, []]), "parse_error"),  # seq
        (subject, raw_delta(replica="b"), "forged"),  # a sidecar naming another replica
        (subject, raw_delta(pool="other"), "forged"),
        (wire.delta_subject("kvcache", POOL, 6, "a"), raw_delta(r=5), "forged"),  # another range's subject
        (subject, raw_delta(sampling=0.5), "sampling_mismatch"),
        (subject, raw_delta(seq=0), None),
        (subject, raw_delta(seq=0), "duplicate"),  # replayed
        (subject, raw_delta(seq=3), None),  # seqs 1 and 2 lost: missed 2
        (subject, raw_delta(seq=2), "duplicate"),  # late, out of order
        (subject, raw_delta(seq=0, epoch=0), "stale"),  # an earlier epoch after a later one
        (subject, raw_delta(seq=4, kind="tensorrt"), "unknown_engine"),
        (subject, raw_delta(seq=4, kind="sglang"), "engine_changed"),  # vLLM's epoch, SGLang's delta
        # a sidecar from before deltas named their engine: read as vLLM's
        (
            subject,
            msgspec.msgpack.encode([1, POOL, "a", 0, 5, 1, 0, 4, 1.0, 1.0, [[True, in_range(5)]]]),
            None,
        ),
    ]

    async def run():
        nc = await nats.connect(nats_server.url)
        js = nc.jetstream()
        await ensure_stream(js, wire.stream_name("kvcache", POOL), f"kvcache.{POOL}.>", 3600, 1 << 30)
        for each, payload, _ in sends:
            await js.publish(each, payload)
        with pytest.raises(nats.js.errors.NoStreamResponseError):  # outside the pool: no stream takes it
            await js.publish(
                wire.delta_subject("kvcache", "other", 5, "a"), raw_delta(pool="other"), timeout=1
            )
        with pytest.raises(nats.errors.MaxPayloadError):  # over NATS's 1 MiB: refused before sending
            await js.publish(subject, b"\x00" * (wire.MAX_DELTA_BYTES + 1))
        s = shard(nats_server)
        await s.start()
        try:
            await settled(s)
            want: dict[str, int] = {}
            for _, _, reason in sends:
                if reason:
                    want[reason] = want.get(reason, 0) + 1
            assert dict(s.intake.dropped) == want
            a = s.intake.fleet.replicas["a"]
            assert (a.resident, a.missed, s.intake.applied, a.engine) == (3, 2, 3, "vllm")
            samples = {(x.name, tuple(x.labels.items())): x.value for x in s.samples()}
            assert samples[("kvcache_fleet_deltas_dropped_total", (("reason", "forged"),))] == 3
            assert samples[("kvcache_kv_events_missed_batches_total", (("replica", "a"),))] == 2
        finally:
            await s.close()
            await nc.close()

    asyncio.run(run())


@pytest.mark.timeout(60)
def test_a_mixed_pool_on_nats_keys_each_engines_hashes_apart(nats_server):
    """A vLLM and an SGLang replica whose block hashes collide: each delta names its engine, so the
    shard counts no block as shared; two vLLM replicas with the same hashes share every one."""

    async def pool(kinds: dict[str, str]) -> FleetResidency:
        publishers = {name: publisher(nats_server, name) for name in kinds}
        intake = shard(nats_server)
        for name, p in publishers.items():
            p.tee(0, lambda _drain, _ts: None, kinds[name])  # serve's wiring: the rank's engine
            p.start()
            p.offer(0, drain(Batch(0, 1.0, (stored(spread(40)),))))
            assert await p.flush()
        await intake.start()
        try:
            await settled(intake)
            assert intake.intake.dropped == {}
            return intake.intake.fleet
        finally:
            for each in (*publishers.values(), intake):
                await each.close()

    mixed = asyncio.run(pool({"v": "vllm", "s": "sglang"}))
    assert {n: v.engine for n, v in mixed.replicas.items()} == {"v": "vllm", "s": "sglang"}
    assert [v.resident for v in mixed.replicas.values()] == [40, 40]
    assert mixed.duplicates == 0 and sum(v.other_replica for v in mixed.replicas.values()) == 0
    control = DeltaIntake(FleetResidency(), POOL)  # the same bytes, both replicas vLLM's
    for name in ("v", "w"):
        for r, hashes in wire.split(spread(40), 1 << 64).items():
            data = wire.encode_delta(POOL, name, 0, r, 1, 0, 0, 1.0, 1.0, [(True, hashes, None, None, None)])
            control.delta(wire.delta_subject("kvcache", POOL, r, name), data)
    assert control.fleet.duplicates == 40 and control.dropped == {}


def test_oversized_and_malformed_counters_are_dropped_without_nats():
    intake = DeltaIntake(FleetResidency(), POOL)
    intake.delta(wire.delta_subject("kvcache", POOL, 5, "a"), b"\x00" * (wire.MAX_DELTA_BYTES + 1))
    counters = wire.counters_subject("kvcache", POOL, "a")
    intake.counters(counters, b"\x00" * (wire.MAX_COUNTERS_BYTES + 1))
    intake.counters(counters, wire.encode(wire.Counters(wire.VERSION, POOL, "b", 1.0, 5.0, 1.0, 16)))
    bad = [wire.VERSION, POOL, "a", 1.0, -5.0, 1.0, 16, None]  # a negative counter
    import msgspec

    intake.counters(counters, msgspec.msgpack.encode(bad))
    intake.counters(counters, wire.encode(wire.Counters(wire.VERSION, POOL, "a", 2.0, 5.0, 1.0, 16)))
    intake.counters(counters, wire.encode(wire.Counters(wire.VERSION, POOL, "a", 2.0, 6.0, 1.0, 16)))
    assert dict(intake.dropped) == {"too_large": 2, "forged": 1, "parse_error": 1, "duplicate": 1}
    assert intake.replicas["a"].counters == {"query_tokens": 5.0, "hit_tokens": 1.0}
    assert intake.block_sizes() == {"a": 16}


def read_all(replicas: dict, queries: float) -> bool:
    return len(replicas) == 2 and all(r.counters["query_tokens"] == queries for r in replicas.values())


@pytest.mark.timeout(60)
def test_aggregate_on_nats_serves_the_pool_from_published_deltas_and_counters(nats_server):
    """`aggregate --fleet.source` as cli.build makes it (no replica to poll): residency from the
    deltas, the pool's hit ratios from the sidecars' published counters, ready once connected."""
    from kvcache_exporter import config
    from kvcache_exporter.aggregator import cli as aggregate_cli
    from kvcache_exporter.cli import build_parser
    from kvcache_exporter.sources.vllm_snapshot import EngineSample, VllmSnapshot

    polled: dict[str, VllmSnapshot] = {}

    def snapshot(queries: float, hits: float) -> VllmSnapshot:
        engines = {("m", "0"): EngineSample({"query_tokens": queries, "hit_tokens": hits})}
        return VllmSnapshot(engines, {"0": {"block_size": "16"}}, "v1", "vllm:", (), ())

    async def run():
        argv = [
            "aggregate",
            "--fleet.source",
            nats_server.url,
            "--fleet.pool",
            POOL,
            "--collect.windows",
            "10m",
        ]
        args = build_parser("aggregate").parse_args(argv)
        flags = {o.key: getattr(args, o.attr) for o in config.AGGREGATE_OPTIONS}
        aggregator = aggregate_cli.build(aggregate_cli.resolve_aggregate(flags, {}, None))
        pubs = {name: publisher(nats_server, name, counters=lambda n=name: polled.get(n)) for name in "ab"}
        for p in pubs.values():
            p.start()
        for name, batch in (
            ("a", Batch(0, 1.0, (stored(spread(50)),))),
            ("b", Batch(0, 1.0, (stored(spread(40, 25)),))),
        ):
            pubs[name].offer(0, drain(batch))  # b stores 25 of a's blocks after a: other_replica
            assert await pubs[name].flush()
        stop = asyncio.Event()
        loop = asyncio.ensure_future(aggregator.run(stop))
        try:
            await until(lambda: len(aggregator.fleet.replicas) == 2)  # the deltas read: a window needs both
            for queries, hits in ((1000.0, 200.0), (3000.0, 600.0)):
                for name, p in pubs.items():
                    polled[name] = snapshot(queries, hits)
                    await until(lambda p=p: p.connected)
                    await p.collect()
                    assert await p.flush()
                await until(lambda q=queries: read_all(aggregator.intake.intake.replicas, q))
                await aggregator.poll_once()
                await asyncio.sleep(0.01)  # the counters' next timestamp
            samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in aggregator.latest}
            assert aggregator.ready and aggregator.members == {}
            assert samples[("kvcache_fleet_replicas", ())] == 2
            assert samples[("kvcache_fleet_hit_ratio", (("window", "10m"),))] == pytest.approx(0.2)
            other = ("kvcache_prefix_cache_miss_tokens_total", (("cause", "other_replica"), ("replica", "b")))
            assert samples[other] == 25 * 16
            assert samples[("kvcache_fleet_query_tokens_total", (("replica", "a"),))] == 3000
        finally:
            stop.set()
            await loop
            for each in pubs.values():
                await each.close()
            await aggregator.close()

    asyncio.run(run())


@pytest.mark.timeout(120)
def test_nats_restarts_the_publisher_buffers_and_the_shard_resumes(nats_server):
    """NATS stops and starts again (same port, same store): the sidecar's buffer holds what the
    replica stored meanwhile, the shard's durable consumer survives; whatever a publish in flight
    lost is counted on both sides alike."""

    async def run():
        a = publisher(nats_server, "a")
        whole = FleetResidency()
        s = shard(nats_server)
        a.start()
        await s.start()
        batches = batches_of(0, 30)
        try:
            for part in (slice(0, 10), slice(10, 20)):
                if part.start == 10:
                    nats_server.stop()
                    await until(lambda: not a.connected)
                a.offer(0, drain(*batches[part]))
                for each in batches[part]:
                    whole.apply("a", each)
            assert a.published < len(batches) and a.lag() > 0  # waiting in the buffer
            nats_server.start()
            a.offer(0, drain(*batches[20:]))  # every range again: any gap shows
            for each in batches[20:]:
                whole.apply("a", each)
            assert await a.flush(30)
            await settled(s, 30)
            lost = sum(a.dropped.values())
            view_a = s.intake.fleet.replicas["a"]
            assert view_a.missed == lost and lost <= 1  # at most the publish in flight when it stopped
            if not lost:
                assert view(s.intake.fleet) == view(whole)
        finally:
            await a.close()
            await s.close()

    asyncio.run(run())
