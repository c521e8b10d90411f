"""The aggregator's poll loop: discovery -> one member per replica (its /metrics poll, run by
`serve`'s Poll: a deadline per source, a crash costs that replica's poll only) -> the fleet view
-> the samples /metrics serves.

Every replica's KV events arrive through one `FleetEvents` (one ZMQ context, a few sockets, one
thread: events.py); each poll drains them into the one `FleetResidency`, which tracks every
replica's sequence numbers and residency itself (no second copy of each hash per replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from .. import catalog as c
from ..collector import Health, Poll
from ..derive.windows import SeriesHistory
from ..durations import window_label
from ..guard import Guard
from ..samples import Sample
from ..sources.base import SourceError
from ..sources.kv_events_decode import Batch, Dropped, weight
from ..sources.vllm import VllmSnapshot, VllmSource
from . import fleet_pool
from .discovery import DiscoveryError, Replica, bounded
from .events import FleetEvents
from .fleet_residency import FleetResidency, HashRange
from .fleet_sessions import SessionSpread

log = logging.getLogger("kvcache_exporter.aggregate")
DRAIN_SECONDS = 0.25
# Per replica, hashes queued between two drains (the rest dropped, budget_exceeded): ~4 s of a
# saturated H200 (stored + removed), so a slow /metrics poll loses none; ~14 MiB at most.
PENDING_HASHES = 131_072
YIELD_HASHES = 8_192  # a heavy drain is applied in slices of this, letting scrapes in between
MAX_POLL_SLOTS = 64
BASE_FDS = 16  # measured: stdio, the event loop, the listener, ZMQ's context and first socket
SCRAPE_RESERVE = 4  # descriptors kept for scrapes of our own /metrics


def poll_slots(publishers: int) -> int:
    """/metrics polls run at once: each opens one connection, so what the open-file limit leaves
    beyond what is open now or soon (one per KV-event publisher, once connected) and the scrapes.
    At least one: 1,000 replicas under 1,024 poll one after another rather than fail."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: what the publishers will take
        open_now = 0
    in_use = max(open_now, BASE_FDS + publishers)
    return max(1, min(MAX_POLL_SLOTS, soft - in_use - SCRAPE_RESERVE))


async def _unless_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run `work` unless `stop` is set first (then cancel it); True when it finished."""
    task, stopped = asyncio.ensure_future(work), asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return False
    task.result()  # its exception, if any, to the caller
    return True


def raise_open_file_limit() -> int:
    """The soft open-file limit up to the hard one, as Go programs (Prometheus) do at start: a
    replica costs one descriptor and 1,024 is a common soft default. Returns the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


@dataclass(frozen=True)
class PoolSettings:
    """What the poll loop needs, from the resolved AggregateSettings (cli.pool_settings)."""

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
    vllm_history: SeriesHistory
    fleet_history: SeriesHistory
    poll: Poll = field(init=False)  # its /metrics, with serve's deadline and crash isolation
    up: bool = False
    block_size: int | None = None
    counters: dict[str, float] = field(default_factory=dict)
    dropped: Counter[str] = field(default_factory=Counter)  # messages its subscriber did not apply


class Aggregator:
    def __init__(self, settings: PoolSettings, discoveries: list, clock: Callable[[], float] = time.time):
        self.settings, self.discoveries, self.clock = settings, discoveries, clock
        self.deadline = max(2 * settings.interval, settings.timeout + 1, 10.0)  # as serve's
        sessions = SessionSpread(retention=max(settings.windows))
        self.fleet = FleetResidency(settings.hash_range, settings.max_blocks_per_replica, sessions)
        self.events = FleetEvents(settings.topic, settings.max_batches_per_second, PENDING_HASHES)
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
            health = self.discovery_health[discovery.name]
            try:
                found += await discovery.refresh()
            except Exception as err:  # the last good answer stands until the source recovers
                error = err if isinstance(err, DiscoveryError) else health.crashed(discovery.name, err)
                found += discovery.last
            self.discovery_health[discovery.name].record(discovery.name, started, self.clock(), error)
        previous = self.left_out
        kept, self.left_out = bounded(found, self.settings.max_replicas)
        if self.left_out != previous and self.left_out:  # once per change, not every interval
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
        if replica.kv_events_endpoint:
            self.events.add(replica.name, replica.kv_events_endpoint)  # vLLM binds; we connect
        self.fleet.add_replica(replica.name)
        member = Member(replica, SeriesHistory(retention), SeriesHistory(retention))
        source = VllmSource(replica.metrics_url, s.timeout, s.max_body_bytes, keep_alive=False)
        member.poll = Poll(
            source, lambda snapshot, ts: self._into(member, snapshot, ts), {"replica": replica.name}
        )
        return member

    def _into(self, member: Member, snapshot: VllmSnapshot | None, ts: float) -> None:
        """One replica's /metrics (None: the poll failed) into its history."""
        member.up = False
        if snapshot is None:
            return
        counters = fleet_pool.replica_counters(snapshot)
        member.vllm_history.append(ts, counters)
        member.counters = counters.counters
        member.block_size = fleet_pool.block_size(snapshot) or member.block_size
        member.up = True

    async def _drain(self, name: str, member: Member) -> None:
        """The batches its publisher sent since the last drain, into the fleet view."""
        if member.replica.kv_events_endpoint is None:
            return
        try:
            drain = self.events.drain(name)
        except SourceError:
            return  # not subscribed: the kv_events success series says so
        applied = 0
        for item in drain.items:
            if isinstance(item, Dropped):
                member.dropped[item.reason] += item.count
                self.fleet.skip(name, item.seq, item.count)
                continue
            for reason in item.refused:  # single events the decoder left out, their batch kept
                member.dropped[reason] += 1
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
        if member.replica.kv_events_endpoint is not None:
            self.events.remove(name)
        await member.poll.close()
        if forget:
            self.fleet.remove_replica(name)

    # --- polling ----------------------------------------------------------------------------

    async def poll_once(self) -> None:
        await self.reconcile(await self.discover())
        publishers = sum(1 for m in self.members.values() if m.replica.kv_events_endpoint)
        slots = asyncio.Semaphore(poll_slots(publishers))

        async def poll(member: Member) -> None:
            async with slots:  # the deadline starts once a slot is free
                await member.poll.run(self.clock, self.deadline)

        await asyncio.gather(*(poll(m) for m in self.members.values()))
        await self.drain_all()
        now = self.clock()
        self.fleet.sessions.age(now)
        sizes = {name: member.block_size for name, member in self.members.items()}
        for name, member in self.members.items():
            view = self.fleet.replicas.get(name)
            if view is not None:
                member.fleet_history.append(now, fleet_pool.fleet_counters(view, self.fleet.scale))
        residency = fleet_pool.residency_samples(self.fleet, sizes)
        residency += fleet_pool.session_samples(*self.fleet.sessions.counts())
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
            out += member.poll.samples()
            if member.up:
                out += [
                    Sample(c.FLEET_QUERY_TOKENS_TOTAL, replica, member.counters["query_tokens"]),
                    Sample(c.FLEET_HIT_TOKENS_TOTAL, replica, member.counters["hit_tokens"]),
                ]
            out += self._event_health(replica, member)
        return out

    def _event_health(self, replica: dict[str, str], member: Member) -> list[Sample]:
        view = self.fleet.replicas.get(replica["replica"])
        if member.replica.kv_events_endpoint is None or view is None:
            return []
        success = float(self.events.healthy(member.replica.name))
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
            try:
                await self._drain(name, member)
            except Exception as err:  # a bug in one replica's stream costs that replica's events
                error = member.poll.health.crashed(f"kv_events {name}", err)
                self.loop_errors += 1
                log.warning("applying KV events failed: %s", error, extra={"replica": name})

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every `interval`; between polls, drain the subscribers every DRAIN_SECONDS so that a
        busy pool's events are applied in small slices, never as one long pause of the event loop."""
        while not stop.is_set():
            started = time.monotonic()
            try:
                if not await _unless_stopped(self.poll_once(), stop):
                    return  # a signal mid-poll: 1,000 replicas' poll is not worth waiting for
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
        await self.events.close()
