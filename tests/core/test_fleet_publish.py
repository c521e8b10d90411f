"""fleet_publish.py: `serve --fleet.publish` against a real nats-server: what it publishes reaches a
shard, NATS down costs counted drops in a bounded buffer and never the sidecar's /metrics, and the
gap the drops leave is marked on the shard once NATS is back."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache_exporter import fleet_wire as wire
from kvcache_exporter.aggregator.fleet_residency import FleetResidency, HashRange
from kvcache_exporter.aggregator.nats_intake import DeltaIntake, NatsIntake
from kvcache_exporter.fleet_publish import FleetPublisher, NatsOptions, described
from kvcache_exporter.sources.kv_events_decode import Batch, Event, KvEventDrain
from tests.conftest import free_port
from tests.core.test_serve import scrape, start, until
from tests.nats_server import NatsServer

POOL = "llama"


@pytest.fixture
def processes(services):
    return services  # every process stops (its whole group) after the test


def every_range(seq: int) -> Batch:
    """One batch storing a hash in each of the 64 ranges: 64 deltas."""
    hashes = tuple((r << 58) + seq for r in range(wire.RANGES))
    return Batch(seq, float(seq), (Event("BlockStored", hashes),))


@pytest.mark.timeout(90)
def test_nats_down_drops_are_counted_and_the_gap_is_marked_once_it_is_back(tmp_path):
    server = NatsServer(tmp_path / "jetstream")  # its port chosen, nothing listening yet

    async def run():
        publisher = FleetPublisher(NatsOptions(server.url), POOL, "a", max_buffered=100)
        publisher.start()
        for seq in range(3):  # three polls' drains: 192 deltas
            publisher.offer(0, KvEventDrain((every_range(seq),)))
        samples = {(s.name, tuple(s.labels.items())): s.value for s in publisher.samples()}
        assert samples[("kvcache_fleet_publish_dropped_total", (("reason", "buffer_full"),))] == 92
        assert samples[("kvcache_fleet_publish_buffered", ())] == 100
        with pytest.raises(Exception, match="not connected"):
            await publisher.collect()
        server.start()
        shard = NatsIntake(NatsOptions(server.url), DeltaIntake(FleetResidency(), POOL))
        await shard.start()
        try:
            await until_async(lambda: publisher.published == 100)
            publisher.offer(0, KvEventDrain((every_range(3),)))  # every range again: each gap shows
            await until_async(lambda: shard.intake.applied == 164)
            view = shard.intake.fleet.replicas["a"]
            assert view.missed == 92 == publisher.dropped["buffer_full"]
            assert view.resident == 164
        finally:
            await publisher.close()
            await shard.close()
            server.stop()

    asyncio.run(run())


@pytest.mark.timeout(90)
def test_a_deleted_stream_is_made_again_and_its_deltas_held_meanwhile(tmp_path):
    server = NatsServer(tmp_path / "jetstream").start()

    async def run():
        publisher = FleetPublisher(NatsOptions(server.url), POOL, "a")
        publisher.start()
        try:
            await until_async(lambda: publisher.connected)
            await publisher._js.stream_info(wire.stream_name("kvcache", POOL))  # the publisher made it
            await publisher._js.delete_stream(wire.stream_name("kvcache", POOL))
            publisher.offer(0, KvEventDrain((every_range(0),)))  # 64 deltas, no stream to take them
            await until_async(lambda: publisher.published == 64)
            assert publisher.dropped["publish_error"] == 0
            info = await publisher._js.stream_info(wire.stream_name("kvcache", POOL))
            assert info.state.messages == 64
        finally:
            await publisher.close()
            server.stop()

    asyncio.run(run())


async def until_async(check, seconds: float = 20.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("not reached in time")


@pytest.mark.timeout(240)
def test_serve_publishes_a_replica_to_a_shard_and_keeps_serving_while_nats_is_down(processes, tmp_path):
    """serve starts before NATS: /metrics answers, says fleet_publish is failing and buffers; NATS
    comes up: the simulator's residency and counters reach a shard."""
    server = NatsServer(tmp_path / "jetstream")
    sim_port, kv_port, port = free_port(), free_port(), free_port()
    start(processes, "simulate", "--listen", f"127.0.0.1:{sim_port}", "--rate", "10",
          "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}")  # fmt: skip
    start(processes, "serve", "--vllm.url", f"http://127.0.0.1:{sim_port}/metrics",
          "--collect.interval", "0.5s", "--web.listen-address", f"127.0.0.1:{port}", "--gpu.source", "none",
          "--kv-events.endpoint", f"tcp://127.0.0.1:{kv_port}",
          "--fleet.publish", server.url, "--fleet.pool", POOL, "--fleet.replica", "r1")  # fmt: skip
    metrics = f"http://127.0.0.1:{port}/metrics"
    publish = ("kvcache_exporter_collector_success", (("collector", "fleet_publish"),))
    down = until(
        lambda: (
            (s := scrape(metrics)).get(("kvcache_fleet_publish_buffered", ()), 0) > 64  # beyond the epoch's
            and s.get(("kvcache_kv_events_batches_total", ()), 0) > 0  # announcement to every range
            and s
        ),
        "buffering",
        timeout=60,
    )
    assert down[publish] == 0 and down[("kvcache_fleet_published_total", ())] == 0
    assert down.get(("kvcache_kv_events_batches_total", ()), 0) > 0  # the sidecar's own view goes on

    async def read_shard():
        server.start()
        shard = NatsIntake(NatsOptions(server.url), DeltaIntake(FleetResidency(), POOL))
        await shard.start()
        try:
            for _ in range(1200):  # 60 s: this VM's 2 cores are shared
                replica = shard.intake.replicas.get("r1")
                view = shard.intake.fleet.replicas.get("r1")
                if replica and replica.block_size and view and view.resident > 0:
                    return replica, view
                await asyncio.sleep(0.05)
            raise AssertionError("the shard never saw r1's residency and counters")
        finally:
            await shard.close()

    try:
        replica, view = asyncio.run(read_shard())
        assert replica.block_size == 16 and replica.counters["query_tokens"] > 0 and view.stored > 0
        up = until(lambda: (s := scrape(metrics)).get(publish) == 1 and s, "publishing", timeout=60)
        assert up[("kvcache_fleet_published_total", ())] > 0
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_wrong_credentials_never_connect_and_right_ones_publish(tmp_path, caplog):
    server = NatsServer(tmp_path / "jetstream", user="sidecar", password="s3cret").start()

    async def run():
        wrong = FleetPublisher(NatsOptions(server.url.replace("s3cret", "guess")), POOL, "a", max_buffered=10)
        right = FleetPublisher(NatsOptions(server.url), POOL, "b")
        for p in (wrong, right):
            p.start()
            p.offer(0, KvEventDrain((every_range(0),)))  # 64 deltas
        try:
            await until_async(lambda: right.published == 64)
            assert not wrong.connected and wrong.published == 0
            assert wrong.dropped["buffer_full"] == 54  # waiting, bounded, counted
            with pytest.raises(Exception, match="not connected") as err:
                await wrong.collect()
            assert "Authorization Violation" in caplog.text  # logged once, without the password:
            assert "guess" not in str(err.value) and "guess" not in caplog.text
        finally:
            for p in (wrong, right):
                await p.close()
            server.stop()

    asyncio.run(run())


def queued(publisher: FleetPublisher) -> list[tuple[str, bytes]]:
    """What the publisher would send, taken off its buffer (no NATS needed)."""
    out = []
    while (item := publisher._next()) is not None:
        publisher._sending = False
        out.append(item[:2])
    return out


def test_a_cleared_cache_and_a_restarted_sidecar_start_new_epochs_that_forget_the_replica():
    fleet = FleetResidency()
    intake = DeltaIntake(fleet, POOL)
    first = FleetPublisher(NatsOptions("nats://127.0.0.1:1"), POOL, "a")
    cleared = Batch(1, 1.0, (Event("AllBlocksCleared"), Event("BlockStored", (7 << 58,))))
    first.offer(0, KvEventDrain((every_range(0), cleared)))
    old = queued(first)
    for subject, payload in old:
        intake.delta(subject, payload)
    view = fleet.replicas["a"]
    assert (view.resident, view.cleared, view.restarts) == (1, 1, 0)  # only the block after the clear
    second = FleetPublisher(NatsOptions("nats://127.0.0.1:1"), POOL, "a")  # the sidecar restarted
    second.offer(0, KvEventDrain((Batch(0, 2.0, (Event("BlockStored", (3 << 58, 4 << 58)),)),)))
    for subject, payload in [*queued(second), old[-1]]:  # then a late delta of the old epoch
        intake.delta(subject, payload)
    assert (view.resident, view.cleared, view.restarts) == (2, 1, 1)
    assert intake.dropped == {"stale": 1} and view.missed == 0


def test_a_range_extends_its_last_change_when_nothing_else_touched_that_range():
    """A store, a removal in range 1 only, a store again: range 2 carries one change of both stores,
    range 1 three in order (what the shard applies, and so its residency, depends on that order)."""
    a, b, c, d = (1 << 58) + 1, (2 << 58) + 1, (1 << 58) + 2, (2 << 58) + 2
    publisher = FleetPublisher(NatsOptions("nats://127.0.0.1:1"), POOL, "a")
    batch = Batch(
        0, 1.0, (Event("BlockStored", (a, b)), Event("BlockRemoved", (a,)), Event("BlockStored", (c, d)))
    )
    publisher.offer(0, KvEventDrain((batch,)))
    deltas = queued(publisher)
    changes = {
        delta.range: [(ch.stored, list(ch.hashes)) for ch in delta.changes]
        for delta in (wire.decode_delta(p, s, "kvcache", POOL) for s, p in deltas)
    }
    assert changes[1] == [(True, [a]), (False, [a]), (True, [c])]
    assert changes[2] == [(True, [b, d])]
    intake = DeltaIntake(FleetResidency(), POOL)
    for subject, payload in deltas:
        intake.delta(subject, payload)
    assert intake.fleet.replicas["a"].resident == 3  # b, c, d: a was removed


def test_hash_sampling_applies_before_publishing_and_shards_of_another_sampling_drop_it():
    half = FleetPublisher(NatsOptions("nats://127.0.0.1:1"), POOL, "a", sampling=0.5)
    half.offer(0, KvEventDrain((every_range(0),)))  # 64 hashes, one per 1/64 of the space
    deltas = queued(half)
    assert len(deltas) == 64  # a new epoch's first deltas reach every range, so every shard sees it
    carrying = [d for d in deltas if wire.decode_delta(d[1], d[0], "kvcache", POOL).changes]
    assert len(carrying) == 32  # the lower half only, now spread over all 64 ranges of the sample
    sampled = DeltaIntake(FleetResidency(HashRange(0.5)), POOL)
    whole = DeltaIntake(FleetResidency(), POOL)
    for subject, payload in deltas:
        sampled.delta(subject, payload)
        whole.delta(subject, payload)
    assert sampled.fleet.replicas["a"].resident == 32 and sampled.dropped == {}
    assert whole.dropped == {"sampling_mismatch": 64} and "a" not in whole.fleet.replicas


def test_a_host_tiers_copies_are_not_published_as_the_pools_residency():
    """SGLang's HiCache backs every GPU store up as CPU_PINNED and evicts host copies on its own; vLLM's
    offload tier publishes CPU events: neither is GPU residency, so neither reaches the pool view."""
    fleet = FleetResidency()
    intake = DeltaIntake(fleet, POOL)
    publisher = FleetPublisher(NatsOptions("nats://127.0.0.1:1"), POOL, "a")
    hashes = (3 << 58, 4 << 58)
    events = (
        Event("BlockStored", hashes, medium="GPU"),
        Event("BlockStored", hashes, medium="CPU_PINNED"),
        Event("BlockRemoved", hashes[:1], medium="CPU_PINNED"),  # the host copy evicted, the GPU's held
        Event("BlockStored", (5 << 58,), medium="CPU"),
    )
    publisher.offer(0, KvEventDrain((Batch(0, 1.0, events),)))
    for subject, payload in queued(publisher):
        intake.delta(subject, payload)
    assert fleet.replicas["a"].resident == 2 and fleet.replicas["a"].stored == 2


HASH = st.one_of(
    st.integers(0, (1 << 64) - 1),
    st.sampled_from([i << 58 for i in range(4)]),  # a few hashes that recur: stored, removed, stored again
)
EVENT = st.one_of(
    st.builds(lambda h, g, s: Event("BlockStored", tuple(h), group=g, session_id=s),
              st.lists(HASH, max_size=6), st.sampled_from([None, 0, 1]), st.sampled_from([None, "s1"])),
    st.builds(lambda h, g: Event("BlockRemoved", tuple(h), group=g), st.lists(HASH, max_size=6),
              st.sampled_from([None, 0, 1])),
    st.just(Event("AllBlocksCleared")),
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(EVENT, max_size=5), max_size=8),
    st.sampled_from([1.0, 0.5]),
    st.sampled_from([1, 3, 4]),
    st.booleans(),
)
def test_any_stream_published_and_read_by_shards_sums_to_the_same_view_as_direct(
    batches, sampling, n, as_bytes
):
    """The publisher's runs and per-range changes keep every hash's order: N shards reading the
    deltas sum to one view fed the same batches directly (bytes hashes too)."""
    if as_bytes:
        batches = [[e._replace(block_hashes=tuple(h.to_bytes(32, "big") for h in e.block_hashes)) for e in b]
                   for b in batches]  # fmt: skip
    stream = [Batch(seq, float(seq), tuple(events)) for seq, events in enumerate(batches)]
    direct = FleetResidency(HashRange(sampling))
    for batch in stream:
        direct.apply("a", batch)
    publisher = FleetPublisher(NatsOptions("nats://127.0.0.1:1"), POOL, "a", sampling=sampling)
    publisher.offer(0, KvEventDrain(tuple(stream)))
    deltas = queued(publisher)
    shards = [DeltaIntake(FleetResidency(HashRange(sampling, k, n)), POOL) for k in range(n)]
    for shard in shards:
        for subject, payload in deltas:
            filters = wire.subject_filters("kvcache", POOL, shard.fleet.hash_range.bounds, sampling)
            if any(subject.startswith(f.removesuffix(">")) for f in filters):  # what NATS delivers it
                shard.delta(subject, payload)
        assert not shard.dropped
    views = [s.fleet.replicas.get("a") for s in shards]
    want = direct.replicas.get("a")
    for field in ("resident", "stored", "removed", "other_replica"):
        assert sum(getattr(v, field) for v in views if v) == (getattr(want, field) if want else 0), field
    assert sum(s.fleet.distinct for s in shards) == direct.distinct


def test_stop_ends_a_loop_whose_cancel_was_swallowed_and_never_waits_forever(caplog):
    """A cancel that lands inside nats-py can come out as another error (next_msg on a closed
    connection) or nothing at all: the loops check `stopping()`, and `stop` never waits forever."""
    from kvcache_exporter.fleet_publish import stop, stopping

    released = asyncio.Event()

    async def swallows_cancels() -> str:
        turns = 0
        while not stopping():
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                turns += 1  # as nats-py's flush does: swallowed, the loop goes on
        return f"stopped after {turns} swallowed cancel(s)"

    async def deaf() -> None:  # a loop that ignores every cancel (no stopping() check)
        while not released.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    async def run():
        polite, stubborn = asyncio.ensure_future(swallows_cancels()), asyncio.ensure_future(deaf())
        await asyncio.sleep(0.05)
        await stop([polite], seconds=5.0)
        assert polite.result() == "stopped after 1 swallowed cancel(s)"
        began = asyncio.get_running_loop().time()
        await stop([stubborn], seconds=0.3)
        assert not stubborn.done() and asyncio.get_running_loop().time() - began < 3.0
        assert "1 NATS task(s) did not stop within 0.3 s; left running" in caplog.text
        released.set()
        await stubborn

    asyncio.run(run())


def test_a_nats_error_is_logged_with_its_code_and_description_and_without_a_subject():
    """nats-py keeps a JetStream error's code and description in its text only (its repr is bare)."""
    from nats.errors import Error, TimeoutError
    from nats.js.errors import BadRequestError

    refused = BadRequestError(code=400, err_code=10005, description="no suitable peers for placement")
    assert repr(refused) == "BadRequestError()"  # what the log said before
    assert "err_code=10005" in described(refused) and "no suitable peers" in described(refused)
    assert described(TimeoutError()) == "TimeoutError: nats: timeout"
    violation = Error('nats: permissions violation for publish to "kvcache.mistral.d.0.1"')
    assert "kvcache.mistral" not in described(violation) and 'publish to "…"' in described(violation)
