"""fleet_resync.py: after a NATS outage overflows the sidecar's buffer, its batches again from the
replay ROUTER of a vLLM-shaped publisher (the simulator's KVEventPublisher, vLLM's wire and replay
protocol) through a real nats-server stopped and started again: the shard ends with the residency
and counts of the whole stream, no gap; when replay no longer has the batches, the marked gap."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from kvcache_exporter.aggregator.fleet_residency import FleetResidency
from kvcache_exporter.fleet_publish import FleetPublisher, NatsOptions
from kvcache_exporter.simulator.blocks import BlockRemoved, BlockStored
from kvcache_exporter.simulator.kv_events import KVEventPublisher
from kvcache_exporter.sources.engine_events import decode_engine_message
from kvcache_exporter.sources.kv_events_decode import Batch, KvEventDrain
from tests.aggregator.test_nats_intake import POOL, settled, shard, spread, until, view
from tests.conftest import free_port
from tests.nats_server import NatsServer

BLOCK = 4


def events_of(i: int) -> list:
    """Stores spread over every range, and now and then a removal of the batch before's."""
    if i % 5 == 4:
        return [BlockRemoved(spread(3, 7 * (i - 1)))]
    hashes = spread(10, 7 * i)
    return [BlockStored(hashes, None, [1] * BLOCK * len(hashes), BLOCK)]


class Replica:
    """A vLLM-shaped publisher with a replay ROUTER, and the sidecar's publisher fed its batches
    as serve feeds it (decoded from the same bytes, offered from a worker thread)."""

    def __init__(self, nats: NatsServer, buffer_steps: int, max_buffered: int):
        self.ctx = zmq.asyncio.Context()
        replay = f"tcp://127.0.0.1:{free_port()}"
        live = f"tcp://127.0.0.1:{free_port()}"  # vLLM connects out to it: nobody listens, no matter
        self.vllm = KVEventPublisher(self.ctx, live, replay, "", 0, buffer_steps=buffer_steps)
        self.sidecar = FleetPublisher(NatsOptions(nats.url), POOL, "a", max_buffered=max_buffered)
        self.ingest = self.sidecar.tee(0, lambda _drain, _ts: None, replay=lambda: (replay, "vllm"))
        self.whole = FleetResidency()  # every batch applied directly: the view without any outage
        self.count = 0

    async def step(self, batches: int = 1) -> None:
        decoded = []
        for _ in range(batches):
            await self.vllm.publish(events_of(self.count))
            seq, payload = self.vllm._buffer[-1]
            decoded.append(decode_engine_message([seq.to_bytes(8, "big"), payload], True))
            self.count += 1
        for batch in decoded:
            self.whole.apply("a", batch)
        await asyncio.to_thread(self.ingest, KvEventDrain(tuple(decoded)), 0.0)

    async def close(self) -> None:
        await self.sidecar.close()
        await self.vllm.close()
        self.ctx.destroy(linger=0)


async def outage(nats: NatsServer, replica: Replica, during: int) -> None:
    """NATS stops while the replica goes on `during` batches, one a poll, then starts again."""
    nats.stop()
    await until(lambda: not replica.sidecar.connected)
    for _ in range(during):
        await replica.step()
    nats.start()
    await until(lambda: replica.sidecar.connected, 30)
    assert await replica.sidecar.flush(30)


async def ten_batches_then_an_outage(nats: NatsServer, replica: Replica, s) -> None:
    """Sidecar and shard started and connected, 10 batches published, then 40 in an outage."""
    replica.sidecar.start()
    await s.start()
    await until(lambda: replica.sidecar.connected and s.connected_once, 20)
    for _ in range(10):
        await replica.step()
    assert await replica.sidecar.flush(20)
    await outage(nats, replica, during=40)


async def polls_until_resynced(replica: Replica, batches: int = 1) -> None:
    """Polls go on after NATS is back: the first with the buffer sent resends the held batches
    (which may fill the buffer again, and the next such poll resends the rest)."""
    for _ in range(20):
        await replica.step(batches)
        assert await replica.sidecar.flush(30)
        if not replica.sidecar._held:
            return
    raise AssertionError("still holding after 20 polls")


@pytest.mark.timeout(120)
def test_an_overflow_in_a_nats_outage_is_resent_from_vllms_replay_and_the_shard_sees_no_gap(tmp_path):
    nats = NatsServer(tmp_path / "jetstream").start()

    async def run():
        replica = Replica(nats, buffer_steps=10_000, max_buffered=100)
        s = shard(nats)
        try:
            await ten_batches_then_an_outage(nats, replica, s)
            assert replica.sidecar.resyncs == {} and replica.sidecar._held  # held, not dropped
            await polls_until_resynced(replica)
            try:  # a shard reconnecting after the outage may still be catching up: until it converges
                await until(lambda: view(s.intake.fleet) == view(replica.whole), 30)
            except AssertionError:
                pass  # the assertions below say how it differs
            assert set(replica.sidecar.resyncs) == {"done"} and not replica.sidecar._held
            assert sum(replica.sidecar.dropped.values()) == 0 and replica.sidecar.resynced_blocks > 0
            assert s.intake.fleet.replicas["a"].missed == 0
            assert view(s.intake.fleet) == view(replica.whole)  # residency and counts of the whole
        finally:
            await replica.close()
            await s.close()

    try:
        asyncio.run(run())
    finally:
        nats.stop()


@pytest.mark.timeout(120)
def test_when_replay_no_longer_has_the_batches_the_gap_is_marked_as_without_replay(tmp_path):
    nats = NatsServer(tmp_path / "jetstream").start()

    async def run():
        replica = Replica(nats, buffer_steps=8, max_buffered=100)  # vLLM keeps only its last 8
        s = shard(nats)
        try:
            await ten_batches_then_an_outage(nats, replica, s)
            await polls_until_resynced(replica, batches=2)  # every range again: the gap shows
            await settled(s, 30)
            assert replica.sidecar.resyncs == {"failed": 1} and not replica.sidecar._held
            assert s.intake.fleet.replicas["a"].missed > 0  # the documented degradation
            resident = s.intake.fleet.replicas["a"].resident
            assert 0 < resident < replica.whole.replicas["a"].resident
        finally:
            await replica.close()
            await s.close()

    try:
        asyncio.run(run())
    finally:
        nats.stop()


def test_a_hold_reads_the_live_sequence_and_a_vllm_restart_makes_replay_impossible():
    from kvcache_exporter.fleet_resync import held_at

    held = held_at(5, 0, False, 5)
    for seq in (5, 6, 7):
        held.saw(Batch(seq, 0.0, ()))
    assert held.waiting and held.last == 7 and not held.restarted
    held.saw(Batch(0, 0.0, ()))  # vLLM started again: its replay no longer has 5..7
    assert held.restarted


def test_replayed_batches_are_offered_up_to_what_the_live_stream_handed_over_in_chunks():
    from kvcache_exporter.fleet_resync import chunked

    batches = [Batch(seq, 0.0, ()) for seq in range(10, 20)]
    assert [[b.seq for b in c] for c in chunked(iter(batches), 16, size=3)] == [
        [10, 11, 12],
        [13, 14, 15],
        [16],
    ]
    assert list(chunked(iter(batches), None)) == []
