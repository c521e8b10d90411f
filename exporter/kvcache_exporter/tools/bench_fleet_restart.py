"""Restart figures of the fleet on NATS (`make bench`): a real nats-server, in-process publishers
(`serve --fleet.publish`'s FleetPublisher) and one shard (`aggregate --fleet.source`'s NatsIntake).

Each figure is a time from a start to "caught up" (the shard's residency equals the whole stream's,
applied directly to a FleetResidency) beside a same-run baseline, and the counts lost: the stored
blocks the whole stream counts less what the shard's runs counted, and the deltas marked missed.
- shard killed mid-stream and restarted (before the consumer's ack wait: what the killed run took
  unacked is not delivered again by then): baseline a fresh shard's cold start on the same stream;
- NATS stopped while the replicas go on, started again: the same baseline;
- a replica restart (vLLM's seq back to 0): until every shard forgot its old blocks, beside one
  ordinary delta's time from offer to applied.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from ..aggregator.fleet_residency import FleetResidency
from ..aggregator.nats_intake import ACK_WAIT, DeltaIntake, NatsIntake
from ..fleet_publish import FleetPublisher, NatsOptions
from ..sources.kv_events_decode import Batch, Event, KvEventDrain
from .soak_fleet import Nats

POOL = "bench"
REPLICAS = 8
BATCHES = 40  # a drain (one poll) of each replica
PER_DRAIN = 10  # batches a drain, 10 hashes each


def spread(n: int, start: int) -> list[int]:
    """n hashes spread over the whole 64-bit space, as vLLM's sha256 hashes are."""
    return [((i + start) * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(n)]


def drain_of(replica: int, drain: int, seq: int) -> list[Batch]:
    """One poll's batches: stores (4 of 10 hashes shared by every replica), every fifth a removal."""
    out = []
    for i in range(PER_DRAIN):
        n = drain * PER_DRAIN + i
        if n % 5 == 4:
            event = Event("BlockRemoved", tuple(spread(3, 1000 * replica + 7 * (n - 1) + 1_000_000)))
        else:
            event = Event(
                "BlockStored", tuple(spread(4, 7 * n) + spread(6, 1000 * replica + 7 * n + 1_000_000))
            )
        out.append(Batch(seq + i, float(n), (event,)))
    return out


class Pool:
    def __init__(self, nats: Nats):
        self.nats = nats
        self.publishers = [FleetPublisher(NatsOptions(nats.url), POOL, f"r{i}") for i in range(REPLICAS)]
        self.whole = FleetResidency()
        self.drains = [0] * REPLICAS
        self.seqs = [0] * REPLICAS

    def start(self) -> None:
        for p in self.publishers:
            p.start()

    def offer(self, drains: int, replicas: range | None = None) -> None:
        for r in replicas or range(REPLICAS):
            for _ in range(drains):
                batches = drain_of(r, self.drains[r], self.seqs[r])
                self.drains[r] += 1
                self.seqs[r] += PER_DRAIN
                self.publishers[r].offer(0, KvEventDrain(tuple(batches)))
                for batch in batches:
                    self.whole.apply(f"r{r}", batch)

    async def flush(self) -> None:
        for p in self.publishers:
            await p.flush(120)

    async def close(self) -> None:
        for p in self.publishers:
            await p.close()


def shard(nats: Nats, durable_prefix: str = "") -> NatsIntake:
    intake = NatsIntake(NatsOptions(nats.url), DeltaIntake(FleetResidency(), POOL, max_replicas=REPLICAS))
    if durable_prefix:  # a consumer of its own: a fresh shard, nothing acked
        intake.durable = lambda index: f"{durable_prefix}-{index}"  # type: ignore[method-assign]
    return intake


def same(shard_fleet: FleetResidency, whole: FleetResidency) -> bool:
    return shard_fleet.distinct == whole.distinct and all(
        shard_fleet.replicas.get(name) is not None and shard_fleet.replicas[name].resident == v.resident
        for name, v in whole.replicas.items()
    )


async def caught_up(intake: NatsIntake, whole: FleetResidency, timeout: float = 120.0) -> float:
    """Seconds until the shard's residency is the whole stream's: nan past `timeout`, or at once
    when the shard marked a delta missed (its residency cannot get there then)."""
    began = time.monotonic()
    while not same(intake.intake.fleet, whole):
        if missed(intake) or time.monotonic() - began > timeout:
            return float("nan")
        await asyncio.sleep(0.01)
    return time.monotonic() - began


async def unacked(nats: Nats, intake: NatsIntake) -> int:
    """Deliveries the killed shard took and never acked: read again by its next run."""
    from ..fleet_publish import connect

    nc = await connect(NatsOptions(nats.url), "bench-restart")
    try:
        return (await nc.jetstream().consumer_info(intake.stream, intake.durable(0))).num_ack_pending or 0
    finally:
        await nc.close()


async def settled(intake: NatsIntake, quiet: float = 1.0, timeout: float = 120.0) -> None:
    """Until the shard has read all the stream holds for it and applied nothing for `quiet` s: its
    counts are final (caught up or not)."""
    began = since = time.monotonic()
    last = -1
    while time.monotonic() - began < timeout:
        count = intake.intake.applied + sum(intake.intake.dropped.values())
        if count != last or any(intake.pending.values()):
            last, since = count, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        await asyncio.sleep(0.05)


def stored(intake: NatsIntake) -> int:
    return sum(v.stored for v in intake.intake.fleet.replicas.values())


def missed(intake: NatsIntake) -> int:
    return sum(v.missed for v in intake.intake.fleet.replicas.values())


async def measure(store: Path) -> dict[str, float]:
    nats = Nats(store / "js", store / "nats.log")
    nats.start()
    pool = Pool(nats)
    out: dict[str, float] = {}
    try:
        pool.start()
        pool.offer(BATCHES // 2)
        await pool.flush()
        first = shard(nats)
        await first.start()  # the times below count from the start call: connecting is part of it
        await caught_up(first, pool.whole)
        feeding = asyncio.ensure_future(_feed(pool, BATCHES // 2))
        await asyncio.sleep(0.5)
        counted = stored(first)  # killed mid-stream: what its run counted
        await first.close()
        killed = time.monotonic()
        out["unacked"] = await unacked(nats, first)
        await feeding
        await pool.flush()
        out["deltas"] = sum(p.published for p in pool.publishers)
        second = shard(nats)  # restarted before the consumer's ack wait: nothing delivered again yet
        await second.start()
        out["restarted_s"] = time.monotonic() - killed
        out["resume_s"] = await caught_up(second, pool.whole)
        await settled(second)
        whole_stored = sum(v.stored for v in pool.whole.replicas.values())
        out["shard_lost"] = whole_stored - counted - stored(second)
        out["shard_missed"] = missed(second)
        cold = shard(nats, "bench-cold")  # the baseline, while the restarted shard idles
        await cold.start()
        out["cold_s"] = await caught_up(cold, pool.whole)
        await cold.close()
        before = stored(second)
        nats.stop()
        pool.offer(BATCHES // 4)  # the replicas go on: the sidecars buffer
        nats.start()
        out["nats_s"] = await caught_up(second, pool.whole)
        await pool.flush()
        await settled(second)
        out["nats_lost"] = (
            sum(v.stored for v in pool.whole.replicas.values()) - whole_stored - (stored(second) - before)
        )
        out["nats_missed"] = missed(second)
        out["nats_dropped"] = sum(sum(p.dropped.values()) for p in pool.publishers)
        pool.offer(1, range(1, 2))  # one ordinary delta's way, the baseline of the next
        out["delta_s"] = await caught_up(second, pool.whole)
        pool.seqs[0] = 0  # replica r0's vLLM restarts: seq 0 again, its cache empty
        pool.offer(1, range(0, 1))
        out["replica_s"] = await caught_up(second, pool.whole)
        out["replica_restarts"] = second.intake.fleet.replicas["r0"].restarts
        await second.close()
    finally:
        await pool.close()
        nats.stop()
    return out


async def outage_past_the_buffer(store: Path, buffer_steps: int) -> dict[str, float]:
    """One replica behind a vLLM-shaped publisher with a replay ROUTER (the simulator's), its
    sidecar's buffer 100 deltas: NATS stops for 60 polls, then the polls go on until no hold."""
    import zmq.asyncio

    from ..fleet_publish import FleetPublisher as Publisher
    from ..simulator.blocks import BlockRemoved, BlockStored
    from ..simulator.kv_events import KVEventPublisher
    from ..sources.engine_events import decode_engine_message
    from .harness import free_port

    nats = Nats(store / f"js-{buffer_steps}", store / "nats.log")
    nats.start()
    ctx = zmq.asyncio.Context()
    replay = f"tcp://127.0.0.1:{free_port()}"
    vllm = KVEventPublisher(ctx, f"tcp://127.0.0.1:{free_port()}", replay, "", 0, buffer_steps=buffer_steps)
    sidecar = Publisher(NatsOptions(nats.url), POOL, "r0", max_buffered=100)
    ingest = sidecar.tee(0, lambda _drain, _ts: None, replay=lambda: (replay, "vllm"))
    whole, s, count = FleetResidency(), shard(nats), 0

    async def poll() -> None:
        nonlocal count
        if count % 5 == 4:
            events = [BlockRemoved(spread(3, 7 * (count - 1)))]
        else:
            events = [BlockStored(spread(10, 7 * count), None, [1] * 40, 4)]
        await vllm.publish(events)
        seq, payload = vllm._buffer[-1]
        batch = decode_engine_message([seq.to_bytes(8, "big"), payload], True)
        count += 1
        whole.apply("r0", batch)
        await asyncio.to_thread(ingest, KvEventDrain((batch,)), 0.0)  # serve's worker thread

    out: dict[str, float] = {}
    try:
        sidecar.start()
        await s.start()
        for _ in range(10):  # each poll sent before the next: the buffer holds 100, a start 64 (a new epoch)
            await poll()
            await sidecar.flush(60)
        await caught_up(s, whole)
        nats.stop()
        for _ in range(60):
            await poll()
        nats.start()
        began = time.monotonic()
        for _ in range(40):
            await poll()
            await sidecar.flush(60)
            if not sidecar._held:
                break
        out["caught_up_s"] = await caught_up(s, whole, 20) + time.monotonic() - began
        view = s.intake.fleet.replicas["r0"]
        out["missed"], out["resident"], out["whole"] = (
            view.missed,
            view.resident,
            whole.replicas["r0"].resident,
        )
        out["done"], out["failed"] = sidecar.resyncs["done"], sidecar.resyncs["failed"]
        out["blocks"] = sidecar.resynced_blocks
    finally:
        await sidecar.close()
        await s.close()
        await vllm.close()
        ctx.destroy(linger=0)
        nats.stop()
    return out


async def _feed(pool: Pool, drains: int) -> None:
    for _ in range(drains):
        pool.offer(1)
        await asyncio.sleep(0.05)


def rows() -> list[tuple[str, str]]:
    with tempfile.TemporaryDirectory(prefix="bench-restart-") as tmp:
        m = asyncio.run(measure(Path(tmp)))
        resync = asyncio.run(outage_past_the_buffer(Path(tmp), 10_000))
        gap = asyncio.run(outage_past_the_buffer(Path(tmp), 8))
    shape = f"{REPLICAS} replicas, {m['deltas']:,.0f} deltas in the stream"
    return [
        (
            f"fleet on NATS: a shard killed mid-stream and restarted ({shape})",
            f"caught up in {m['resume_s']:.2f} s (rebuild from the stream + resume from its consumer) "
            f"beside a fresh shard's cold start on the same stream {m['cold_s']:.2f} s; "
            f"{m['shard_lost']:.0f} stored blocks lost, {m['shard_missed']:.0f} deltas missed "
            f"({m['unacked']:.0f} deltas taken by the killed run and never acked; restarted "
            f"{m['restarted_s']:.2f} s after the kill, the consumer's ack wait {ACK_WAIT:.0f} s)",
        ),
        (
            "fleet on NATS: nats-server stopped while the replicas go on, started again",
            f"caught up {m['nats_s']:.2f} s after its start (beside the cold start {m['cold_s']:.2f} s); "
            f"{m['nats_lost']:.0f} stored blocks lost, {m['nats_missed']:.0f} deltas missed, "
            f"{m['nats_dropped']:.0f} dropped by the sidecars",
        ),
        (
            "fleet on NATS: a replica restarts (its seq back to 0)",
            f"its old blocks gone from the shard in {m['replica_s']:.3f} s (restarts counted "
            f"{m['replica_restarts']:.0f}) beside {m['delta_s']:.3f} s for one ordinary delta",
        ),
        (
            "fleet on NATS: nats-server down for 60 polls, the sidecar's buffer (100 deltas) overflowing",
            f"resent from vLLM's replay: caught up {_num(resync['caught_up_s'], '.2f')} s after NATS "
            f"started, {resync['missed']:.0f} deltas missed, {resync['resident']:.0f} resident blocks on "
            f"the shard where the stream has {resync['whole']:.0f} (resyncs {resync['done']:.0f} done, "
            f"{resync['blocks']:.0f} blocks "
            f"resent); beside the same outage with a replay that kept only 8 batches (resync failed "
            f"{gap['failed']:.0f}): {gap['missed']:.0f} deltas missed, {gap['resident']:.0f} resident "
            f"blocks where the stream has {gap['whole']:.0f}",
        ),
    ]


def _num(value: float, spec: str) -> str:
    return "never (in 20 s)" if value != value else format(value, spec)


if __name__ == "__main__":
    for label, value in rows():
        print(f"| {label} | {value} |")
