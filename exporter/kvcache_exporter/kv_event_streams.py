"""`serve`'s KV-event streams: one subscriber and event view per data-parallel rank, from the flags
or from what vLLM says at /kv_event_sources (sources/kv_event_sources.py), re-pointed when its
answer changes (a restart on other ports). See docs/kv-events.md, "Discovery"."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import catalog as c
from .collector import Poll
from .derive.attribution import Attribution
from .derive.fields import Rules
from .derive.front_fields import FrontFields
from .derive.kv_events import EventState
from .derive.layouts import OrderBudget
from .derive.state import PollState, TargetState
from .derive.units import UnitView
from .samples import Sample
from .settings import Settings
from .sources.base import SourceError
from .sources.kv_event_sources import Found, Settled, Stream

log = logging.getLogger("kvcache_exporter")
# Of each poll interval, the time the KV events it drained may take to apply (the rest are dropped,
# budget_exceeded): vLLM's series are published when the poll ends, never a whole interval late.
KV_EVENTS_APPLY_SHARE = 0.25
STATES = ("unknown", "found", "none_published", "no_route")
PUBLISHER_STATES = ("connected", "disconnected", "never_connected")  # as sources/kv_events.py has them
# Polls after which a rank no publisher ever connected to is logged (60 s at the default 5 s interval).
NEVER_CONNECTED_POLLS = 12
# Once vLLM gave the same answer this many asks in a row it is asked only every REASK_SECONDS, and
# at once when its /metrics comes back up (a restart): an ask costs about as much as a /metrics
# poll beside one vLLM (docs/benchmarks.md), for an answer that changes only when vLLM restarts.
SETTLED_ASKS = 3
REASK_SECONDS = 30.0


def rank_endpoint(endpoint: str, rank: int) -> str:
    from .sources.kv_events import rank_endpoint as offset  # here: pyzmq is ~1.2 MiB unused

    return offset(endpoint, rank)


class RankStream:
    """One rank's KV-event subscriber (the Source the poll loop sees), re-pointed when vLLM's answer
    moves the rank: the old subscriber is closed at the next collect, the rank's event view stays
    (the new publisher's sequence starting again reads as a publisher restart)."""

    name = "kv_events"

    def __init__(self, s: Settings):
        self.settings = s
        self.stream: Stream | None = None
        self.current: Any = None  # the KvEventSubscriber
        self._retired: list[Any] = []

    def point(self, stream: Stream | None) -> None:
        if stream == self.stream:
            return
        from .sources.kv_events import KvEventSubscriber  # here: pyzmq is ~1.2 MiB unused

        if self.current is not None:
            self._retired.append(self.current)
        self.stream, self.current = stream, None
        if stream is not None:
            self.current = KvEventSubscriber(
                stream.endpoint,
                mode=stream.mode,
                topic=stream.topic,
                replay_endpoint=stream.replay_endpoint,
                max_batches_per_second=self.settings.kv_events_max_batches_per_second,
                with_tokens=True,
                engine=stream.engine,
            )
            self.current.start()  # needs the running event loop: build_exporter is called from serve()

    @property
    def publisher_state(self) -> str | None:
        return self.current.publisher_state if self.current is not None else None

    async def collect(self) -> Any:
        await self._close_retired()
        if self.current is None:
            raise SourceError("not_announced", "vLLM no longer announces this rank's KV events")
        return await self.current.collect()

    async def close(self) -> None:
        self.point(None)
        await self._close_retired()

    async def _close_retired(self) -> None:
        while self._retired:
            await self._retired.pop().close()


def replay_of(stream: Stream | None) -> tuple[str | None, str]:
    """Where the rank's replay endpoint is now (None: none) and its engine's kind."""
    return (stream.replay_endpoint, stream.engine) if stream is not None else (None, "vllm")


@dataclass
class RankWiring:
    """What each rank's event view feeds besides attribution, the same for every rank: the front
    namer (--fields.tokenizer, derive/front_fields.py) and the fleet publisher (--fleet.publish)."""

    decode: Callable[[list[int]], str] | None = None
    rules: Rules | None = None
    publisher: Any = None  # fleet_publish.FleetPublisher
    fronts: dict[str, FrontFields] = field(default_factory=dict)  # by rank: /debug/fields


def kv_events_poll(
    s: Settings,
    state: PollState,
    rank: int,
    stream: Stream | None,
    labels: dict[str, str],
    wiring: RankWiring,
    target: TargetState | None = None,
) -> Poll:
    """One rank's subscriber and its event view, miss attribution and hit units, joined with
    `target` (the vLLM it belongs to)."""
    source = RankStream(s)
    source.point(stream)
    engine = stream.engine if stream is not None else "vllm"
    per_second = s.kv_events_reorder_per_second
    attribution = Attribution(
        s.kv_events_max_tracked_blocks,
        s.kv_events_max_fingerprints,
        order_budget=OrderBudget(per_second) if per_second else None,
    )
    if wiring.decode is not None and wiring.rules is not None:
        attribution.fields = wiring.fronts[str(rank)] = FrontFields(
            wiring.decode, wiring.rules, s.fields_max_per_second
        )
    events = state.add_kv_events(
        EventState(s.kv_events_max_tracked_blocks),
        labels,
        attribution=attribution,
        units=UnitView(s.kv_events_max_tracked_blocks, sessions_compute=engine == "sglang"),
        budget=KV_EVENTS_APPLY_SHARE * s.collect_interval,
        target=target,
    )
    into = events.ingest
    if wiring.publisher is not None:  # resyncs after a NATS outage from the rank's replay endpoint
        into = wiring.publisher.tee(rank, events.ingest, engine, lambda: replay_of(source.stream))
    return RankPoll(source, into, labels, offload=True)  # up to 100k batches a poll


@dataclass
class RankPoll(Poll):
    """One rank's poll, with its publisher's state; a rank no publisher has connected to for
    NEVER_CONNECTED_POLLS polls is logged once (a data-parallel size above vLLM's, a wrong port)."""

    silent_polls: int = 0

    async def run(self, clock: Callable[[], float], deadline: float) -> None:
        await super().run(clock, deadline)
        if self.source.publisher_state != "never_connected":
            self.silent_polls = 0
            return
        self.silent_polls += 1
        if self.silent_polls == NEVER_CONNECTED_POLLS:
            log.warning(
                "KV events of %s: no publisher has connected to %s in %d polls (is vLLM's data-parallel "
                "size smaller than --kv-events.data-parallel-size, or the endpoint wrong?)",
                self.title,
                self.source.stream.endpoint if self.source.stream else "?",
                NEVER_CONNECTED_POLLS,
            )

    def samples(self) -> list[Sample]:
        state = self.source.publisher_state
        own = [
            Sample(c.KV_EVENTS_PUBLISHER_STATE, {**self.labels, "state": s}, float(s == state))
            for s in PUBLISHER_STATES
        ]
        return super().samples() + (own if state is not None else [])


@dataclass
class DiscoveredKvEvents:
    """Follows vLLM's answer (once settled): a rank seen for the first time gets its poll (from the
    next poll on), a rank whose stream moved is re-pointed, a rank no longer announced is let go."""

    settings: Settings
    state: PollState
    wiring: RankWiring
    polls: list[Poll] = field(default_factory=list)  # the exporter's own list, set once it exists
    ranks: dict[int, RankStream] = field(default_factory=dict)
    answer: Settled = field(default_factory=Settled)
    target: TargetState | None = None  # the vLLM asked: its streams are joined with its /metrics
    engine_labels: bool | None = None  # decided by the first answer with streams, then kept

    def into(self, found: Found | None, ts: float) -> None:
        """The discovery poll's answer (None: it failed, the last answer stands)."""
        if found is not None and self.answer.offer(found):
            self._apply(found)
            log.info("KV events from %s: %s", found.asked, found.describe())

    def _apply(self, found: Found) -> None:
        wanted = {stream.rank: stream for stream in found.streams}
        if self.engine_labels is None and wanted:
            self.engine_labels = len(wanted) > 1 or max(wanted) > 0
        for rank, stream in wanted.items():
            if rank not in self.ranks:  # made with its stream: its engine's rules (Stream.engine) set then
                labels = self._labels(rank)
                poll = kv_events_poll(
                    self.settings, self.state, rank, stream, labels, self.wiring, self.target
                )
                self.ranks[rank] = poll.source
                self.polls.append(poll)
                continue
            self.ranks[rank].point(stream)
        for rank, source in self.ranks.items():
            if rank not in wanted:
                source.point(None)

    def _labels(self, rank: int) -> dict[str, str]:
        return {"engine": str(rank)} if self.engine_labels or rank > 0 else {}

    def samples(self) -> list[Sample]:
        found = self.answer.found or Found(state="unknown")
        return [
            Sample(c.KV_EVENTS_DISCOVERED_ENDPOINTS, {}, float(len(found.streams))),
            *(Sample(c.KV_EVENTS_DISCOVERY_STATE, {"state": s}, float(s == found.state)) for s in STATES),
            *(
                Sample(c.KV_EVENTS_DISCOVERY_REJECTED, {"reason": r}, float(n))
                for r, n in found.rejected.items()
            ),
            Sample(c.KV_EVENTS_DISCOVERY_CHANGES_TOTAL, {}, float(self.answer.changes)),
        ]


@dataclass
class DiscoveryPoll(Poll):
    """The poll of /kv_event_sources: its health series and what it found."""

    view: DiscoveredKvEvents | None = None

    def samples(self) -> list[Sample]:
        return super().samples() + (self.view.samples() if self.view is not None else [])


class PacedDiscovery:
    """The discovery source asked every poll until its answer settles, then every `reask` seconds
    or when `target` (the vLLM asked) comes back up; between asks the last answer stands."""

    name = "kv_event_discovery"

    def __init__(
        self,
        source: Any,
        target: TargetState | None,
        clock: Callable[[], float],
        reask: float = REASK_SECONDS,
    ):
        self.source, self.target, self.clock, self.reask = source, target, clock, reask
        self.last: Any = None  # the last answer (a Found)
        self.same = 0  # asks in a row that gave `last`
        self.asked_at = float("-inf")
        self.was_up = True

    def due(self) -> bool:
        """Whether `collect` has anything to do: an ask, or the vLLM's up/down change to note. A
        poll that is not due is skipped (Poll.due): its health stays that of the last ask."""
        up = self.target is None or self.target.up
        return up != self.was_up or not self._settled()

    def _settled(self) -> bool:
        return self.same >= SETTLED_ASKS and self.clock() - self.asked_at < self.reask

    async def collect(self) -> Any:
        up = self.target is None or self.target.up
        came_up, self.was_up = up and not self.was_up, up
        if self._settled() and not came_up:
            return self.last
        self.asked_at = self.clock()
        try:
            found = await self.source.collect()
        except Exception:
            self.same = 0
            raise
        self.same = self.same + 1 if found == self.last else 1
        self.last = found
        return found

    async def close(self) -> None:
        await self.source.close()
