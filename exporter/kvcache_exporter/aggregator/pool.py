"""The aggregator's pool: the state its rows (rows.py) are wired into and `serve`'s engine
(kit.engine, collector.Exporter) runs: discovery -> one member per replica (its /metrics poll) ->
the fleet view -> the derivation table of pool_samples.py. The polls of each round come from
discovery (`refresh`), as many at once as the open-file budget allows, each with its deadline and
crash isolation, and the same health series and error tally as `serve`.

Every replica's KV events arrive through one `FleetEvents` (one ZMQ context, a few sockets, one
thread: events.py), one stream per data-parallel rank (named (replica, rank)); each poll drains
them into the one `FleetResidency`, which tracks every rank's sequence numbers and residency itself
(no second copy of each hash per replica).
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .. import kit
from ..collector import Poll
from ..derive.windows import SeriesHistory
from ..samples import Sample
from ..sources.base import SourceError
from ..sources.kv_event_sources import Found, KvEventDiscovery, Settled
from ..sources.kv_events_decode import Batch, Dropped, weight
from ..sources.sglang import EngineSource
from ..sources.vllm_snapshot import VllmSnapshot
from . import fleet_pool
from .descriptors import SCRAPE_RESERVE, FdBudget, open_file_limit, open_now
from .discovery import DnsSd, FileSd, RankStream, Replica, StaticSd, bounded
from .events import FleetEvents
from .fleet_residency import FleetResidency, HashRange
from .fleet_sessions import SessionSpread
from .nats_intake import NatsIntake
from .rows import ROWS

log = logging.getLogger("kvcache_exporter.aggregate")
DRAIN_SECONDS = 0.25
YIELD_HASHES = 8_192  # a heavy drain is applied in slices of this, letting scrapes in between
CLOSE_AT_ONCE = 64  # replicas closed in parallel at shutdown


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
    source_options: dict[str, Any] = field(default_factory=dict)  # a registered SourceKit's (kit.py)


@dataclass
class KvSources:
    """What one replica's vLLM says about its KV events: the asker, the answer in force, when to ask."""

    discovery: KvEventDiscovery
    answer: Settled = field(default_factory=Settled)
    due: float = 0.0


def fleet_endpoint(replica: Replica, found: Found | None) -> Replica:
    """The replica with every rank's KV-event stream as vLLM says; as it was when vLLM has no route
    or nothing was asked. A rank that binds (tcp://*:PORT, the way for a fleet) is connected on the
    replica's host; one that connects out to the replica's own address is bound there, which works
    where the aggregator runs on that host; one that connects to another host is not followed."""
    if replica.kv_events_named or found is None or found.state == "no_route":
        return replica
    ranks = tuple(
        RankStream(s.rank, s.endpoint, s.mode)
        for s in found.streams
        if s.mode == "connect" or s.rank not in found.other_host
    )
    return replace(replica, kv_events_endpoint=None, kv_events_ranks=ranks)


def stream_name(replica: str, rank: int) -> tuple[str, int]:
    """A rank's stream in FleetEvents and the open-file budget."""
    return (replica, rank)


@dataclass
class Discovered:
    """One discovery as a source of the engine: what it found, its last good answer while it fails
    (DiscoveryError: the failure is its health series'), and collector="discovery_..." on both."""

    discovery: StaticSd | FileSd | DnsSd
    found: list[Replica] = field(default_factory=list)
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = self.discovery.name

    async def collect(self) -> list[Replica]:
        return await self.discovery.refresh()

    def into(self, replicas: list[Replica] | None, ts: float) -> None:
        self.found = list(self.discovery.last) if replicas is None else replicas

    async def close(self) -> None:
        pass


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
    """The pool: its members, the fleet view and the intakes; its engine is built from rows.ROWS."""

    def __init__(
        self,
        settings: PoolSettings,
        discoveries: list,
        clock: Callable[[], float] = time.time,
        fd_limit: int | None = None,
        intake: Callable[[FleetResidency], NatsIntake] | None = None,
    ):
        self.settings, self.discoveries, self.clock = settings, discoveries, clock
        sessions = SessionSpread(retention=max(settings.windows))
        self.fleet = FleetResidency(settings.hash_range, settings.max_blocks_per_replica, sessions)
        self.make_intake = intake  # --fleet.source: NATS
        self.intake: NatsIntake | None  # the rows' parts (rows.py)
        self.events: FleetEvents
        self.members: dict[str, Member] = {}
        self.kv_sources: dict[str, KvSources] = {}
        self.discovered = [Discovered(d) for d in discoveries]
        self.left_out = 0
        self._left_out_names: frozenset[str] = frozenset()
        self.fds = FdBudget(fd_limit or open_file_limit())
        self.fd_exhausted: Counter[str] = Counter()  # polls each replica went unsubscribed, by the budget
        self._logged_unsubscribed = 0
        self.parts: dict[str, Any] = {}  # a registered source's own part (kit.py)
        self.engine = kit.engine(
            ROWS,
            settings,
            self,
            settings,
            interval=settings.interval,
            clock=clock,
            refresh=self.refresh,
            limit=lambda: self.fds.poll_slots(open_now()),
            drain=self.drain_all,
            drain_every=DRAIN_SECONDS,
            up=self.any_up,
            registered=kit.registered("aggregate"),
        )

    @property
    def latest(self) -> list[Sample]:
        return self.engine.latest

    @property
    def ready(self) -> bool:
        return self.engine.ready

    def any_up(self) -> bool:
        return any(m.up for m in self.members.values()) or (
            self.intake is not None and self.intake.connected_once
        )

    # --- membership -------------------------------------------------------------------------

    async def discover(self) -> list[Replica]:
        """The replicas every discovery found at this round's discovery polls (the engine ran
        them), at most --replica.max, with the KV-event streams each one's vLLM names."""
        found = [replica for d in self.discovered for replica in d.found]
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
        waiting_streams = (
            (key, stream, self.members[name].replica.engine)
            for name in sorted(self.members)
            for stream in self.members[name].replica.streams()
            if (key := stream_name(name, stream.rank)) not in self.fds.subscribed
        )
        for key, stream, engine in waiting_streams:
            if self.fds.full():  # each take costs a pass over the subscribed: none once none fits
                break
            if self.fds.take(key, stream.endpoint, bind=stream.mode == "bind"):
                self.events.add(key, stream.endpoint, stream.mode, engine)
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
            for stream in member.replica.streams():
                everyone.take(stream_name(name, stream.rank), stream.endpoint, bind=stream.mode == "bind")
        return everyone.in_use() + SCRAPE_RESERVE + self.fds.poll_fds - self.fds.limit

    def unsubscribed(self) -> list[str]:
        """Replicas with a KV-event stream that the open-file budget did not subscribe."""
        return sorted(
            name
            for name, member in self.members.items()
            if any(stream_name(name, s.rank) not in self.fds.subscribed for s in member.replica.streams())
        )

    def _member(self, replica: Replica) -> Member:
        s = self.settings
        retention = max(s.windows) + 2 * s.interval
        self.fleet.add_replica(replica.name, replica.engine)
        member = Member(replica, SeriesHistory(retention), SeriesHistory(retention))
        kind = "sglang" if replica.engine == "sglang" else "auto"  # the page says vLLM or SGLang
        source = EngineSource(replica.metrics_url, s.timeout, s.max_body_bytes, keep_alive=False, kind=kind)
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
        """The batches each of its ranks' publishers sent since the last drain, into the fleet view."""
        for stream in member.replica.streams():
            try:
                drain = self.events.drain(stream_name(name, stream.rank))
            except SourceError:
                continue  # not subscribed: the kv_events success series says so
            applied = 0
            for item in drain.items:
                if isinstance(item, Dropped):
                    member.dropped[item.reason] += item.count
                    self.fleet.skip(name, item.seq, item.count, stream.rank)
                    continue
                for reason in item.refused:  # single events the decoder left out, their batch kept
                    member.dropped[reason] += 1
                self.ingest(name, item, stream.rank)
                applied += weight(item.events)[0]
                if applied >= YIELD_HASHES:
                    applied = 0
                    await asyncio.sleep(0)

    def ingest(self, name: str, batch: Batch, rank: int = 0) -> None:
        """One decoded batch of replica `name`'s rank; a replica dropped meanwhile stays dropped."""
        if name in self.fleet.replicas:
            self.fleet.apply(name, batch, rank)

    async def _drop(self, name: str, forget: bool) -> None:
        """Stop watching; `forget` (gone from discovery) also drops what it held from the pool view.
        A replica whose endpoints changed keeps its view: a restart shows as its seq going back."""
        member = self.members.pop(name)
        for key in [k for k in self.fds.subscribed if k[0] == name]:
            self.fds.release(key)
            self.events.remove(key)
        self.fd_exhausted.pop(name, None)
        await member.poll.close()
        if forget:
            self.fleet.remove_replica(name)

    # --- polling ----------------------------------------------------------------------------

    async def refresh(self) -> list[Poll]:
        """The polls of this round: one per replica discovery finds now."""
        await self.reconcile(await self.discover())
        self.fd_exhausted.update(self.unsubscribed())
        return [m.poll for m in self.members.values()]

    async def poll_once(self) -> None:
        await self.engine.poll_once()

    def end_poll(self, now: float) -> None:
        """After the polls and their drain: the fleet counters' histories, for the windows."""
        self.fleet.sessions.age(now)
        if self.intake is not None:
            self.intake.intake.record(now)
        for name, member in self.members.items():
            view = self.fleet.replicas.get(name)
            if view is not None:
                member.fleet_history.append(now, fleet_pool.fleet_counters(view, self.fleet.scale))

    def streams_healthy(self, member: Member) -> bool:
        name = member.replica.name
        return all(self.events.healthy(stream_name(name, s.rank)) for s in member.replica.streams())

    async def drain_all(self) -> None:
        for name, member in list(self.members.items()):
            try:
                await self._drain(name, member)
            except Exception as err:  # a bug in one replica's stream costs that replica's events
                error = self.engine.crashed(f"kv_events {name}", err)
                log.warning("applying KV events failed: %s", error, extra={"replica": name})

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every `interval`, draining the subscribers every DRAIN_SECONDS in between so that a
        busy pool's events are applied in small slices, never as one long pause of the event loop."""
        if self.intake is not None:
            await self.intake.start()
        await self.engine.run(stop)

    async def close(self) -> None:
        """At SIGTERM: every replica's poll closed, CLOSE_AT_ONCE at a time, then the one ZMQ
        context. The fleet view is not taken apart replica by replica: the process is ending."""
        _ = self.engine.latest  # the last poll's page stays what it was with its replicas held
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
