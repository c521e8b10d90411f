"""The aggregator's poll loop: discovery -> one member per replica (its /metrics poll and KV-event
subscriber, the same source classes `serve` uses) -> the fleet view -> the samples /metrics serves.

The subscribers receive and decode in their own threads; each poll drains every subscriber
(the Source protocol's collect()) into the one `FleetResidency`, which tracks every replica's
sequence numbers and residency itself (no second copy of each hash in a per-replica EventState).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import catalog as c
from ..collector import Health
from ..config import window_label
from ..derive.windows import SeriesHistory
from ..guard import Guard
from ..samples import Sample
from ..sources.base import SourceError
from ..sources.kv_events import Batch, KvEventSubscriber
from ..sources.kv_events_decode import Dropped, weight
from ..sources.vllm import VllmSource
from . import fleet_pool
from .discovery import DiscoveryError, Replica, bounded
from .fleet_residency import FleetResidency, HashRange

log = logging.getLogger("kvcache_exporter.aggregate")
DRAIN_SECONDS = 0.25
# Per replica, hashes queued between two drains (the rest dropped, budget_exceeded): ~4 s of a
# saturated H200 (stored + removed), so a slow /metrics poll loses none; ~14 MiB at most.
PENDING_HASHES = 131_072
YIELD_HASHES = 8_192  # a heavy drain is applied in slices of this, letting scrapes in between


@dataclass(frozen=True)
class AggregateSettings:
    windows: tuple[float, ...] = (300.0, 3600.0)
    interval: float = 5.0
    max_replicas: int = 64
    max_blocks_per_replica: int = 131_072
    hash_range: HashRange = field(default_factory=HashRange)
    topic: str = ""
    timeout: float = 5.0
    max_body_bytes: int = 8 * 1024 * 1024
    max_batches_per_second: float = 20000


@dataclass
class Member:
    """One replica being watched."""

    replica: Replica
    source: VllmSource
    subscriber: KvEventSubscriber | None
    vllm_history: SeriesHistory
    fleet_history: SeriesHistory
    health: Health = field(default_factory=Health)
    up: bool = False
    block_size: int | None = None
    counters: dict[str, float] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)  # messages its subscriber did not apply


class Aggregator:
    def __init__(
        self, settings: AggregateSettings, discoveries: list, clock: Callable[[], float] = time.time
    ):
        self.settings, self.discoveries, self.clock = settings, discoveries, clock
        self.fleet = FleetResidency(settings.hash_range, settings.max_blocks_per_replica)
        self.members: dict[str, Member] = {}
        self.discovery_health = {d.name: Health() for d in discoveries}
        self.left_out = 0
        self.ready = False
        self.guard = Guard()  # the last check before exposition, as in serve
        self.loop_errors = 0
        self.latest: list[Sample] = []

    # --- membership -------------------------------------------------------------------------

    async def discover(self) -> list[Replica]:
        found: list[Replica] = []
        for discovery in self.discoveries:
            started, error = self.clock(), None
            try:
                found += await discovery.refresh()
            except DiscoveryError as err:
                error = err
                found += discovery.last  # the last good answer stands until the source recovers
            self.discovery_health[discovery.name].record(discovery.name, started, self.clock(), error)
        kept, self.left_out = bounded(found, self.settings.max_replicas)
        if self.left_out:
            log.warning("more replicas than --replica.max: %d left out", self.left_out)
        return kept

    async def reconcile(self, replicas: list[Replica]) -> None:
        wanted = {r.name: r for r in replicas}
        for name in [n for n, m in self.members.items() if wanted.get(n) != m.replica]:
            await self._drop(name, forget=name not in wanted)
        for name, replica in wanted.items():
            if name not in self.members:
                self.members[name] = self._member(replica)

    def _member(self, replica: Replica) -> Member:
        s = self.settings
        retention = max(s.windows) + 2 * s.interval
        subscriber = None
        if replica.kv_events_endpoint:
            subscriber = KvEventSubscriber(
                replica.kv_events_endpoint,
                mode="connect",  # vLLM binds (tcp://*:5557); the sidecar and we both connect
                topic=s.topic,
                max_batches_per_second=s.max_batches_per_second,
                max_pending_hashes=PENDING_HASHES,
            )
            subscriber.start()
        self.fleet.add_replica(replica.name)
        return Member(
            replica,
            VllmSource(replica.metrics_url, s.timeout, s.max_body_bytes),
            subscriber,
            SeriesHistory(retention),
            SeriesHistory(retention),
        )

    async def _drain(self, name: str, member: Member) -> None:
        """The batches its subscriber received since the last poll, into the fleet view."""
        if member.subscriber is None:
            return
        try:
            drain = await member.subscriber.collect()
        except SourceError:
            return  # the socket is down: member.subscriber.healthy says so
        applied = 0
        for item in drain.items:
            if isinstance(item, Dropped):
                member.dropped[item.reason] += item.count
                self.fleet.skip(name, item.seq, item.count)
                continue
            self.ingest(name, item)
            applied += weight(item.events)[0]
            if applied >= YIELD_HASHES:
                applied = 0
                await asyncio.sleep(0)

    def ingest(self, name: str, batch: Batch) -> None:
        """One decoded batch of replica `name`; a replica dropped meanwhile stays dropped."""
        if name in self.fleet.replicas:
            self.fleet.apply(name, batch)

    async def _drop(self, name: str, forget: bool) -> None:
        """Stop watching; `forget` (gone from discovery) also drops what it held from the pool view.
        A replica whose endpoints changed keeps its view: a restart shows as its seq going back."""
        member = self.members.pop(name)
        if member.subscriber is not None:
            await member.subscriber.stop()
        await member.source.close()
        if forget:
            self.fleet.remove_replica(name)

    # --- polling ----------------------------------------------------------------------------

    async def _poll(self, member: Member) -> None:
        started, error = self.clock(), None
        try:
            snapshot = await member.source.collect()
            counters = fleet_pool.replica_counters(snapshot)
            member.vllm_history.append(self.clock(), counters)
            member.counters = counters.counters
            member.block_size = fleet_pool.block_size(snapshot) or member.block_size
        except SourceError as err:
            error = err
        member.up = error is None
        member.health.record(f"vllm {member.replica.name}", started, self.clock(), error)

    async def poll_once(self) -> None:
        await self.reconcile(await self.discover())
        await asyncio.gather(*(self._poll(m) for m in self.members.values()))
        await self.drain_all()
        now = self.clock()
        sizes = {name: member.block_size for name, member in self.members.items()}
        for name, member in self.members.items():
            view = self.fleet.replicas.get(name)
            if view is not None:
                member.fleet_history.append(now, fleet_pool.fleet_counters(view, self.fleet.scale))
        residency = fleet_pool.residency_samples(self.fleet, sizes)
        self.ready = self.ready or any(m.up for m in self.members.values())
        samples = self.guard.filter(residency + self._pool_samples() + self._health_samples())
        self.latest = samples + self._own_errors()

    def _own_errors(self) -> list[Sample]:
        errors = self.guard.errors + Counter(internal_error=self.loop_errors)
        return [
            Sample(c.EXPORTER_ERRORS_TOTAL, {"collector": "derive", "reason": reason}, n)
            for reason, n in errors.items()
            if n
        ]

    def _pool_samples(self) -> list[Sample]:
        out: list[Sample] = []
        slice_scale = float(self.settings.hash_range.shards)
        for seconds in self.settings.windows:
            windows = [
                (m.vllm_history.window(seconds), m.fleet_history.window(seconds), m.block_size)
                for m in self.members.values()
            ]
            pool = fleet_pool.pool_window(windows, slice_scale)
            out += fleet_pool.window_samples(window_label(seconds), pool)
        return out

    def _health_samples(self) -> list[Sample]:
        out = [Sample(c.FLEET_REPLICAS, {}, float(len(self.members)))]
        out.append(Sample(c.FLEET_REPLICAS_LEFT_OUT, {}, float(self.left_out)))
        for name, health in self.discovery_health.items():
            out += health.samples({"collector": name})
        for name, member in self.members.items():
            replica = {"replica": name}
            out.append(Sample(c.VLLM_UP, replica, float(member.up)))
            out += member.health.samples({**replica, "collector": "vllm"})
            if member.up:
                out += [
                    Sample(c.FLEET_QUERY_TOKENS_TOTAL, replica, member.counters["query_tokens"]),
                    Sample(c.FLEET_HIT_TOKENS_TOTAL, replica, member.counters["hit_tokens"]),
                ]
            out += self._event_health(replica, member)
        return out

    def _event_health(self, replica: dict[str, str], member: Member) -> list[Sample]:
        view = self.fleet.replicas.get(replica["replica"])
        if member.subscriber is None or view is None:
            return []
        success = float(member.subscriber.healthy)
        return [
            Sample(c.EXPORTER_COLLECTOR_SUCCESS, {**replica, "collector": "kv_events"}, success),
            Sample(c.KV_EVENTS_BATCHES_TOTAL, replica, view.batches),
            Sample(c.KV_EVENTS_MISSED_BATCHES_TOTAL, replica, view.missed),
            *(
                Sample(c.KV_EVENTS_DROPPED_TOTAL, {**replica, "reason": reason}, n)
                for reason, n in member.dropped.items()
            ),
        ]

    async def drain_all(self) -> None:
        for name, member in list(self.members.items()):
            await self._drain(name, member)

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every `interval`; between polls, drain the subscribers every DRAIN_SECONDS so that a
        busy pool's events are applied in small slices, never as one long pause of the event loop."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception:  # a bug must not end the loop: count it, log it, keep the last samples
                self.loop_errors += 1
                log.exception(
                    "aggregator poll failed", extra={"collector": "derive", "reason": "internal_error"}
                )
            while (delay := self.settings.interval - (time.monotonic() - started)) > 0:
                try:
                    await asyncio.wait_for(stop.wait(), timeout=min(delay, DRAIN_SECONDS))
                    return
                except TimeoutError:
                    await self.drain_all()

    async def close(self) -> None:
        for name in list(self.members):
            await self._drop(name, forget=True)
