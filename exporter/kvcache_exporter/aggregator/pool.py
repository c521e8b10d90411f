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
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

from .. import catalog as c
from ..collector import Health, Poll
from ..derive.windows import SeriesHistory
from ..durations import window_label
from ..guard import Guard
from ..samples import Sample
from ..sources.base import SourceError
from ..sources.kv_event_sources import Found, KvEventDiscovery, Settled
from ..sources.kv_events_decode import Batch, Dropped, weight
from ..sources.vllm import VllmSnapshot, VllmSource
from . import fleet_pool
from .descriptors import SCRAPE_RESERVE, FdBudget, open_file_limit, open_now
from .discovery import DiscoveryError, Replica, bounded
from .events import FleetEvents
from .fleet_residency import FleetResidency, HashRange
from .fleet_sessions import SessionSpread
from .nats_intake import NatsIntake

log = logging.getLogger("kvcache_exporter.aggregate")
DRAIN_SECONDS = 0.25
# Per replica, hashes queued between two drains (the rest dropped, budget_exceeded): ~4 s of a
# saturated H200 (stored + removed), so a slow /metrics poll loses none; ~14 MiB at most.
PENDING_HASHES = 131_072
YIELD_HASHES = 8_192  # a heavy drain is applied in slices of this, letting scrapes in between
CLOSE_AT_ONCE = 64  # replicas closed in parallel at shutdown


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
    kv_events_discovery: bool = True  # ask each replica's /kv_event_sources where it publishes
    kv_sources_every: float = 30.0  # ask again this often, and every poll while it is down


@dataclass
class KvSources:
    """What one replica's vLLM says about its KV events: the asker, the answer in force, when to ask."""

    discovery: KvEventDiscovery
    answer: Settled = field(default_factory=Settled)
    due: float = 0.0


def fleet_endpoint(replica: Replica, found: Found | None) -> Replica:
    """The replica with its KV-event endpoint as vLLM says (rank 0: the fleet view is one stream a
    replica); as it was when vLLM has no route or nothing was asked; none when vLLM publishes
    nothing, or connects out itself (the aggregator only connects: vLLM must bind tcp://*:PORT)."""
    if replica.kv_events_named or found is None or found.state == "no_route":
        return replica
    stream = next((s for s in found.streams if s.rank == 0), None)
    endpoint = stream.endpoint if stream is not None and stream.mode == "connect" else None
    return replace(replica, kv_events_endpoint=endpoint)


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
    def __init__(
        self,
        settings: PoolSettings,
        discoveries: list,
        clock: Callable[[], float] = time.time,
        fd_limit: int | None = None,
        intake: Callable[[FleetResidency], NatsIntake] | None = None,
    ):
        self.settings, self.discoveries, self.clock = settings, discoveries, clock
        self.deadline = max(2 * settings.interval, settings.timeout + 1, 10.0)  # as serve's
        sessions = SessionSpread(retention=max(settings.windows))
        self.fleet = FleetResidency(settings.hash_range, settings.max_blocks_per_replica, sessions)
        self.intake = intake(self.fleet) if intake is not None else None  # --fleet.source: NATS
        self.events = FleetEvents(settings.topic, settings.max_batches_per_second, PENDING_HASHES)
        self.members: dict[str, Member] = {}
        self.kv_sources: dict[str, KvSources] = {}
        self.discovery_health = {d.name: Health() for d in discoveries}
        self.left_out = 0
        self._left_out_names: frozenset[str] = frozenset()
        self.fds = FdBudget(fd_limit or open_file_limit())
        self.fd_exhausted: Counter[str] = Counter()  # polls each replica went unsubscribed, by the budget
        self._logged_unsubscribed = 0
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
        kept, self.left_out = bounded(found, self.settings.max_replicas)
        left_out = frozenset(r.name for r in found) - {r.name for r in kept}
        if left_out != self._left_out_names and left_out:  # once, and again when the set changes
            log.warning("more replicas than --replica.max: %d left out", self.left_out)
        self._left_out_names = left_out
        if not self.settings.kv_events_discovery:
            return kept
        await self.ask_kv_sources(kept)
        return [fleet_endpoint(r, self._answer(r.name)) for r in kept]

    def _answer(self, name: str) -> Found | None:
        sources = self.kv_sources.get(name)
        return sources.answer.found if sources is not None else None

    async def ask_kv_sources(self, replicas: list[Replica]) -> None:
        """Each replica's /kv_event_sources when due: first seen, down at the last poll (a restart may
        move its ports), or every kv_sources_every; a failed ask keeps the last answer."""
        now = self.clock()
        for name in set(self.kv_sources) - {r.name for r in replicas}:
            await self.kv_sources.pop(name).discovery.close()
        due = []
        for replica in replicas:
            if replica.kv_events_named:
                continue
            sources = self.kv_sources.get(replica.name)
            if sources is None:
                discovery = KvEventDiscovery(replica.metrics_url, self.settings.timeout, keep_alive=False)
                sources = self.kv_sources[replica.name] = KvSources(discovery)
            member = self.members.get(replica.name)
            if now >= sources.due or member is None or not member.up or sources.answer.pending:
                due.append((replica.name, sources))
        slots = asyncio.Semaphore(self.fds.poll_slots(open_now()))

        async def ask(name: str, sources: KvSources) -> None:
            async with slots:
                try:
                    found = await sources.discovery.collect()
                except SourceError:
                    return  # its /metrics poll says whether it is down
                sources.due = now + self.settings.kv_sources_every
                if sources.answer.offer(found):
                    log.info(
                        "KV events from /kv_event_sources: %s", found.describe(), extra={"replica": name}
                    )

        await asyncio.gather(*(ask(name, sources) for name, sources in due))

    async def reconcile(self, replicas: list[Replica]) -> None:
        wanted = {r.name: r for r in replicas}
        for name in [n for n, m in self.members.items() if wanted.get(n) != m.replica]:
            await self._drop(name, forget=name not in wanted)
        for name, replica in wanted.items():
            if name not in self.members:
                self.members[name] = self._member(replica)
        self.fds.set_poll_urls(r.metrics_url for r in replicas)
        self._subscribe_waiting()

    def _subscribe_waiting(self) -> None:
        """Subscribe the replicas the open-file budget left out, as far as it now allows (replicas
        gone free descriptors); one log line whenever how many are left out changes."""
        for name in sorted(n for n in self.members if n not in self.fds.subscribed):
            if self.fds.full():  # each take costs a pass over the subscribed: none once none fits
                break
            endpoint = self.members[name].replica.kv_events_endpoint
            if endpoint and self.fds.take(name, endpoint):
                self.events.add(name, endpoint, self.members[name].replica.engine)  # it binds; we connect
        waiting = self.unsubscribed()
        if len(waiting) != self._logged_unsubscribed and waiting:
            log.warning(
                "open-file limit %d: KV events of %d replicas not subscribed (fd_exhausted), e.g. %s; "
                "raise the limit (ulimit -n, LimitNOFILE) by %d",
                self.fds.limit,
                len(waiting),
                waiting[0],
                self._descriptors_short(),
                extra={"collector": "kv_events", "reason": "fd_exhausted"},
            )
        elif self._logged_unsubscribed and not waiting:
            log.info("every replica's KV events subscribed again", extra={"collector": "kv_events"})
        self._logged_unsubscribed = len(waiting)

    def _descriptors_short(self) -> int:
        """What subscribing every replica would take beyond the limit."""
        everyone = FdBudget(sys.maxsize)
        for name, member in self.members.items():
            if member.replica.kv_events_endpoint:
                everyone.take(name, member.replica.kv_events_endpoint)
        return everyone.in_use() + SCRAPE_RESERVE + self.fds.poll_fds - self.fds.limit

    def unsubscribed(self) -> list[str]:
        """Replicas with a KV-event endpoint that the open-file budget did not subscribe."""
        wanted = (n for n, m in self.members.items() if m.replica.kv_events_endpoint)
        return sorted(n for n in wanted if n not in self.fds.subscribed)

    def _member(self, replica: Replica) -> Member:
        s = self.settings
        retention = max(s.windows) + 2 * s.interval
        self.fleet.add_replica(replica.name, replica.engine)
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
        if name in self.fds.subscribed:
            self.fds.release(name)
            self.events.remove(name)
        self.fd_exhausted.pop(name, None)
        await member.poll.close()
        if forget:
            self.fleet.remove_replica(name)

    # --- polling ----------------------------------------------------------------------------

    async def poll_once(self) -> None:
        await self.reconcile(await self.discover())
        self.fd_exhausted.update(self.unsubscribed())
        slots = asyncio.Semaphore(self.fds.poll_slots(open_now()))

        async def poll(member: Member) -> None:
            async with slots:  # the deadline starts once a slot is free
                await member.poll.run(self.clock, self.deadline)

        await asyncio.gather(*(poll(m) for m in self.members.values()))
        await self.drain_all()
        now = self.clock()
        self.fleet.sessions.age(now)
        sizes = {name: member.block_size for name, member in self.members.items()}
        if self.intake is not None:
            self.intake.intake.record(now)
            sizes |= self.intake.intake.block_sizes()
        for name, member in self.members.items():
            view = self.fleet.replicas.get(name)
            if view is not None:
                member.fleet_history.append(now, fleet_pool.fleet_counters(view, self.fleet.scale))
        residency = fleet_pool.residency_samples(self.fleet, sizes)
        residency += fleet_pool.session_samples(*self.fleet.sessions.counts())
        self.ready = self.ready or any(m.up for m in self.members.values())
        self.ready = self.ready or (self.intake is not None and self.intake.connected_once)
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
            if self.intake is not None:
                windows += self.intake.intake.windows(seconds)
            pool = fleet_pool.pool_window(windows, slice_scale)
            out += fleet_pool.window_samples(window_label(seconds), pool)
        return out

    def _health_samples(self) -> list[Sample]:
        watched = len(self.members) if self.intake is None else len(self.fleet.replicas)
        out = [Sample(c.FLEET_REPLICAS, {}, float(watched))]
        if self.intake is not None:
            out += self.intake.samples()
        for name in self.members:
            found = self._answer(name)
            count = sum(s.rank == 0 and s.mode == "connect" for s in found.streams) if found else 0
            out.append(Sample(c.KV_EVENTS_DISCOVERED_ENDPOINTS, {"replica": name}, float(count)))
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
        collector = {**replica, "collector": "kv_events"}
        out = [
            Sample(c.EXPORTER_COLLECTOR_SUCCESS, collector, success),
            Sample(c.KV_EVENTS_BATCHES_TOTAL, replica, view.batches),
            Sample(c.KV_EVENTS_MISSED_BATCHES_TOTAL, replica, view.missed),
            *(
                Sample(c.KV_EVENTS_DROPPED_TOTAL, {**replica, "reason": reason}, n)
                for reason, n in member.dropped.items()
            ),
        ]
        if refused := self.fd_exhausted.get(replica["replica"]):  # polls it went unsubscribed
            out.append(Sample(c.EXPORTER_ERRORS_TOTAL, {**collector, "reason": "fd_exhausted"}, refused))
        return out

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
        if self.intake is not None:
            await self.intake.start()
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
        """At SIGTERM: every replica's poll closed, CLOSE_AT_ONCE at a time, then the one ZMQ
        context. The fleet view is not taken apart replica by replica: the process is ending."""
        slots = asyncio.Semaphore(CLOSE_AT_ONCE)

        async def drop(name: str) -> None:
            async with slots:
                await self._drop(name, forget=False)

        await asyncio.gather(*(drop(name) for name in list(self.members)))
        for sources in self.kv_sources.values():
            await sources.discovery.close()
        await self.events.close()
        if self.intake is not None:
            await self.intake.close()
