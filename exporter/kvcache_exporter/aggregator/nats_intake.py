"""`aggregate --fleet.source nats://...`: one shard's part of the pool, read from NATS JetStream
(docs/fleet.md, "On NATS"; the wire format is fleet_wire.py).

The shard reads only the subjects of its hash ranges, through durable pull consumers (one per
aligned block of ranges), and every replica's counters through an ephemeral consumer that starts
with the last message of each replica. `DeltaIntake` (pure) checks each message and feeds the same
`FleetResidency` the ZMQ fan-in feeds; `NatsIntake` does the I/O.

Restart: the durable consumer remembers what the shard acked. A restarted shard first reads the
retained stream up to that point with counting off (residency rebuilt, counters not counted twice),
then resumes right after it: deliveries the last run took and never acked (killed between a fetch
and its ack) come again, in order, before anything newer. Deltas older than the stream's retention
are gone: size it from the stream's rate (docs/fleet.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import catalog as c
from .. import fleet_wire as wire
from ..derive.windows import SeriesHistory
from ..fleet_publish import (
    STREAM_MAX_AGE,
    STREAM_MAX_BYTES,
    NatsOptions,
    connect,
    described,
    ensure_stream,
    log_once,
    stop,
    stopping,
)
from ..samples import Sample
from ..sources.kv_events_decode import Event, Mark
from ..sources.vllm_snapshot import EngineSample
from . import fleet_pool
from .fleet_residency import FleetResidency, ReplicaView

log = logging.getLogger("kvcache_exporter.aggregate")

FETCH_BATCH = 256
FETCH_TIMEOUT = 1.0
ACK_WAIT = 10.0  # an unacked delivery comes again after this: a shard killed mid-batch
RETRY_SECONDS = 1.0


@dataclass
class ReplicaCounters:
    """One replica's published prefix-cache counters and fleet counters, as the pool's windows read them."""

    vllm_history: SeriesHistory
    fleet_history: SeriesHistory
    block_size: int | None = None
    last_ts: float = float("-inf")
    counters: dict[str, float] = field(default_factory=dict)


class DeltaIntake:
    """Checks every message against its subject, the replica's epoch and each range's sequence, then
    applies it to the fleet view. Pure: the caller hands it subjects and bytes."""

    def __init__(
        self,
        fleet: FleetResidency,
        pool: str,
        prefix: str = "kvcache",
        max_replicas: int = 64,
        retention: float = 3600.0,
    ):
        self.fleet, self.pool, self.prefix = fleet, pool, prefix
        self.max_replicas, self.retention = max_replicas, retention
        self.epochs: dict[str, int] = {}
        self._next: dict[str, dict[tuple[int, int], int]] = {}  # replica -> (engine, range) -> next seq
        self._from_start: dict[str, bool] = {}
        self.replicas: dict[str, ReplicaCounters] = {}
        self.applied = 0
        self.redelivered = 0
        self.dropped: Counter[str] = Counter()
        self._within = wire.ranges_within(fleet.hash_range.bounds, fleet.hash_range.sampling)

    def delta(self, subject: str, data: bytes) -> None:
        try:
            delta = wire.decode_delta(data, subject, self.prefix, self.pool)
        except wire.WireError as err:
            self.dropped[err.reason] += 1
            log.debug("dropping a delta on %s: %s", subject, err)
            return
        if delta.sampling != self.fleet.hash_range.sampling:
            self.dropped["sampling_mismatch"] += 1
            return
        name = delta.replica
        if name not in self.fleet.replicas and len(self.fleet.replicas) >= self.max_replicas:
            self.dropped["too_many_replicas"] += 1
            return
        view = self.fleet.replicas.get(name)
        if view is not None and view.engine != delta.kind and delta.epoch == self.epochs.get(name):
            self.dropped["engine_changed"] += 1  # an epoch is one engine's: a new one may be another's
            return
        mark = self._place(name, delta)
        if mark is None:
            return
        within = delta.range in self._within  # the subject's range is wholly this shard's: no filter
        self.fleet.apply_marked(name, [_event(change) for change in delta.changes], mark, within=within)
        self.applied += 1

    def _place(self, name: str, delta: wire.Delta) -> Mark | None:
        """The delta's place in the replica's stream: None to drop it (stale or duplicate)."""
        known = self.epochs.get(name)
        if known is not None and delta.epoch < known:
            self.dropped["stale"] += 1
            return None
        if delta.epoch != known:
            self.epochs[name] = delta.epoch
            self._next[name] = {}
            self._from_start[name] = known is not None  # saw the epoch begin: each range counts from 0
            if known is not None:  # the replica's cache started empty: forget what it held
                if wire.CAUSES[delta.cause] == "cleared":
                    self.fleet.clear(name)
                else:
                    self.fleet.restart(name)
            self.fleet.add_replica(name, delta.kind).engine = delta.kind  # its blocks, if any, forgotten
        following, key = self._next[name], (delta.engine, delta.range)
        expected = following.get(key, 0 if self._from_start[name] else None)
        if expected is not None and delta.seq < expected:
            self.dropped["duplicate"] += 1
            return None
        following[key] = delta.seq + 1
        return Mark(delta.seq - expected if expected is not None else 0, False)

    def counters(self, subject: str, data: bytes) -> None:
        try:
            counters = wire.decode_counters(data, subject, self.prefix, self.pool)
        except wire.WireError as err:
            self.dropped[err.reason] += 1
            return
        replica = self.replicas.get(counters.replica)
        if replica is None:
            if len(self.replicas) >= self.max_replicas:
                self.dropped["too_many_replicas"] += 1
                return
            replica = ReplicaCounters(SeriesHistory(self.retention), SeriesHistory(self.retention))
            self.replicas[counters.replica] = replica
        if counters.ts <= replica.last_ts:
            self.dropped["duplicate"] += 1
            return
        values = {"query_tokens": counters.query_tokens, "hit_tokens": counters.hit_tokens}
        replica.vllm_history.append(
            counters.ts, EngineSample(counters=values, start_time=counters.start_time)
        )
        replica.block_size = counters.block_size or replica.block_size
        replica.last_ts, replica.counters = counters.ts, values
        self.applied += 1

    def quiet(self) -> None:
        """After a rebuild: the residency stays, what it counted was counted by the shard's last run."""
        for view in self.fleet.replicas.values():
            for name in ("stored", "other_replica", "removed", "overflow", "batches", "missed"):
                setattr(view, name, 0)
            view.restarts = view.cleared = 0
        self.applied = self.redelivered = 0
        self.dropped.clear()

    # --- what the poll loop reads -----------------------------------------------------------

    def record(self, now: float) -> None:
        for name, view in self.fleet.replicas.items():
            replica = self.replicas.get(name)
            if replica is not None:
                replica.fleet_history.append(now, fleet_pool.fleet_counters(view, self.fleet.scale))

    def windows(self, seconds: float) -> list[fleet_pool.ReplicaWindow]:
        return [
            (r.vllm_history.window(seconds), r.fleet_history.window(seconds), r.block_size)
            for r in self.replicas.values()
        ]

    def block_sizes(self) -> dict[str, int | None]:
        return {name: r.block_size for name, r in self.replicas.items()}

    def samples(self) -> list[Sample]:
        out = [
            Sample(c.FLEET_DELTAS_TOTAL, {}, float(self.applied)),
            Sample(c.FLEET_CONSUMER_REDELIVERED_TOTAL, {}, float(self.redelivered)),
            *(Sample(c.FLEET_DELTAS_DROPPED_TOTAL, {"reason": r}, float(n)) for r, n in self.dropped.items()),
        ]
        for name, replica in self.replicas.items():
            labels = {"replica": name}
            if replica.counters:
                out.append(Sample(c.FLEET_QUERY_TOKENS_TOTAL, labels, replica.counters["query_tokens"]))
                out.append(Sample(c.FLEET_HIT_TOKENS_TOTAL, labels, replica.counters["hit_tokens"]))
        for name, view in self.fleet.replicas.items():
            out += _event_health(name, view)
        return out


def _event(change: wire.Change) -> Event:
    """The change as decode's Event (positional: a delta's per-message cost is most of a shard's)."""
    if change.stored:
        return Event("BlockStored", change.hashes, None, (), 0, change.adapter, None, None, change.group,
                     None, None, change.session)  # fmt: skip
    return Event("BlockRemoved", change.hashes, None, (), 0, change.adapter, None, None, change.group)


def _event_health(name: str, view: ReplicaView) -> list[Sample]:
    replica = {"replica": name}
    return [
        Sample(c.KV_EVENTS_BATCHES_TOTAL, replica, float(view.batches)),
        Sample(c.KV_EVENTS_MISSED_BATCHES_TOTAL, replica, float(view.missed)),
    ]


class NatsIntake:
    """The shard's consumers on one NATS connection; `start` after the poll loop's event loop runs."""

    def __init__(
        self,
        options: NatsOptions,
        intake: DeltaIntake,
        shard: tuple[int, int] = (0, 1),
        retention: float = STREAM_MAX_AGE,
        max_bytes: int = STREAM_MAX_BYTES,
        clock: Callable[[], float] | None = None,
        replicas: int = 1,
    ):
        self.options, self.intake, self.shard = options, intake, shard
        self.stream_retention, self.max_bytes, self.replicas = retention, max_bytes, replicas
        prefix, pool = intake.prefix, intake.pool
        self.stream = wire.stream_name(prefix, pool)
        hash_range = intake.fleet.hash_range
        self.filters = wire.subject_filters(prefix, pool, hash_range.bounds, hash_range.sampling)
        self.pending: dict[str, float] = {}
        self.connected_once = False
        self.rebuilt = 0  # deltas read again at start
        self._nc: Any = None
        self._tasks: list[asyncio.Task] = []

    def durable(self, index: int) -> str:
        k, n = self.shard
        return f"{self.stream}-shard-{k}-of-{n}-{index}"

    async def start(self) -> None:
        self._tasks.append(asyncio.ensure_future(self._run()))

    @property
    def connected(self) -> bool:
        return self._nc is not None and self._nc.is_connected

    async def _run(self) -> None:
        while not stopping():
            try:
                await self._connect_and_consume()
                return
            except asyncio.CancelledError:
                raise
            except Exception as err:  # NATS down at start, no stream yet: try again
                log_once(f"NATS {self.options.where}: {described(err)}; retrying every second")
                await self._close_connection()
                await asyncio.sleep(RETRY_SECONDS)

    async def _connect_and_consume(self) -> None:
        from nats.js import api

        k, n = self.shard
        self._nc = await connect(self.options, f"kvcache-aggregate-{self.stream}-{k}-of-{n}")
        js = self._nc.jetstream()
        await ensure_stream(
            js,
            self.stream,
            f"{self.intake.prefix}.{self.intake.pool}.>",
            self.stream_retention,
            self.max_bytes,
            self.replicas,
        )
        subs = []
        for index, subject in enumerate(self.filters):
            durable = self.durable(index)
            floor = await self._resume_point(js, durable)
            if floor:
                await self._rebuild(js, subject, floor)
            config = api.ConsumerConfig(
                ack_policy=api.AckPolicy.ALL, ack_wait=ACK_WAIT, max_ack_pending=FETCH_BATCH * 4
            )
            if floor:  # used only when the consumer is made (new, or deleted just now): bound as it is
                config.deliver_policy, config.opt_start_seq = api.DeliverPolicy.BY_START_SEQUENCE, floor + 1
            subs.append((durable, await js.pull_subscribe(subject, durable, self.stream, config)))
        if self.rebuilt:
            self.intake.quiet()
            log.info("rebuilt the shard's residency from %d retained deltas", self.rebuilt)
        counters = api.ConsumerConfig(
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            ack_policy=api.AckPolicy.NONE,
            inactive_threshold=60,
        )
        counters_filter = f"{self.intake.prefix}.{self.intake.pool}.c.>"
        subs.append(("counters", await js.pull_subscribe(counters_filter, None, self.stream, counters)))
        self.connected_once = True
        async with asyncio.TaskGroup() as consumers:  # cancelled with _run: none outlives it
            for name, sub in subs:
                consumers.create_task(self._consume(name, sub))

    async def _resume_point(self, js: Any, durable: str) -> int:
        """The stream sequence the consumer acked last (0: none, or no consumer). A consumer with
        deliveries out that were never acked (the last run killed between a fetch and its ack) is
        deleted, to be made again from just past that point: left as it is, it would deliver what
        comes after them first, and the next ack (AckPolicy.ALL) would acknowledge them unread."""
        from nats.js.errors import NotFoundError

        try:
            info = await js.consumer_info(self.stream, durable)
        except NotFoundError:
            return 0
        floor = info.ack_floor.stream_seq if info.ack_floor else 0
        if not info.num_ack_pending:
            return floor
        log.info("consumer %s: %d deliveries never acked; read again", durable, info.num_ack_pending)
        await js.delete_consumer(self.stream, durable)
        return floor

    async def _rebuild(self, js: Any, subject: str, floor: int) -> None:
        """What the consumer acked before this start, read again for the residency only."""
        from nats.errors import TimeoutError as NatsTimeout
        from nats.js import api

        config = api.ConsumerConfig(ack_policy=api.AckPolicy.NONE, inactive_threshold=30)
        sub = await js.pull_subscribe(subject, None, self.stream, config)
        try:
            while True:
                try:
                    msgs = await sub.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT)
                except NatsTimeout:
                    return  # nothing more retained
                for msg in msgs or ():
                    if msg.metadata.sequence.stream > floor:
                        return
                    self.intake.delta(msg.subject, msg.data)
                    self.rebuilt += 1
                await asyncio.sleep(0)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _consume(self, name: str, sub: Any) -> None:
        from nats.errors import TimeoutError as NatsTimeout

        handle = self.intake.counters if name == "counters" else self.intake.delta
        while not stopping():
            try:
                msgs = await sub.fetch(FETCH_BATCH, timeout=FETCH_TIMEOUT)
            except NatsTimeout:
                self.pending[name] = 0.0
                continue
            except asyncio.CancelledError:
                raise
            except Exception as err:  # NATS down: the client reconnects; ask again after a pause
                log.debug("fetch on %s failed: %s", name, err)
                await asyncio.sleep(RETRY_SECONDS)
                continue
            if not msgs:
                continue
            for msg in msgs:
                if msg.metadata.num_delivered > 1:
                    self.intake.redelivered += 1
                handle(msg.subject, msg.data)
            if name != "counters":
                self.pending[name] = float(msgs[-1].metadata.num_pending)
                with contextlib.suppress(Exception):  # not acked: delivered again after ACK_WAIT
                    await msgs[-1].ack()
            await asyncio.sleep(0)  # scrapes between two fetches

    def samples(self) -> list[Sample]:
        out = self.intake.samples()
        out += [Sample(c.FLEET_CONSUMER_PENDING, {"consumer": name}, n) for name, n in self.pending.items()]
        return out

    async def _close_connection(self) -> None:
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = None

    async def close(self) -> None:
        await stop(self._tasks)
        self._tasks.clear()
        await self._close_connection()
