"""The poll loop: sources -> poll state -> derivations -> the samples /metrics renders.

The exporter polls on its own cadence so that windowed measures never depend on who scrapes it
or how often. The derivations run when /metrics is read, once per poll at most (`Exporter.latest`):
a pure function of the poll state gives the same page then as at the poll's end, and polls nobody
reads (a 1 s poll under a 15 s scrape) cost no derivation. Every source goes through one wrapper
(`Poll.run`, node_exporter's `execute()`): it is timed, its success, duration, last success and
errors by reason are recorded, a problem is logged once per reason, and an unexpected exception is
an `internal_error`, never the loop's end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import catalog as c
from .deadline import Deadline
from .derive.registry import DERIVATIONS
from .derive.state import PollState
from .guard import Guard
from .samples import Sample
from .sources.base import Source, SourceError, SourceUnavailable

log = logging.getLogger("kvcache_exporter")


@dataclass
class Health:
    """What the exporter says about one collector."""

    success: bool = False
    duration: float = 0.0
    last_success: float | None = None
    errors: Counter[str] = field(default_factory=Counter)
    last_problem: str | None = None
    _tracebacks: set[str] = field(default_factory=set)

    def record(self, name: str, started: float, ended: float, error: SourceError | None) -> None:
        self.duration = ended - started
        self.success = error is None
        if error is None:
            self.last_success = ended
            if self.last_problem is not None:
                log.info("collector recovered", extra={"collector": name})
            self.last_problem = None
            return
        if isinstance(error, SourceUnavailable):
            if self.last_problem != "unavailable":
                log.debug("source unavailable: %s", error, extra={"collector": name})
        else:
            self.errors[error.reason] += 1
            if self.last_problem != error.reason:  # log a problem once, not every poll
                log.warning("collector failed: %s", error, extra={"collector": name, "reason": error.reason})
        self.last_problem = error.reason

    def crashed(self, name: str, err: BaseException) -> SourceError:
        """An exception no source should raise: internal_error, its traceback once at debug."""
        kind = type(err).__name__
        if kind not in self._tracebacks:
            self._tracebacks.add(kind)
            log.debug("traceback of %s's %s", name, kind, exc_info=err, extra={"collector": name})
        return SourceError("internal_error", f"{kind}: {err}")

    def samples(self, labels: dict[str, str]) -> list[Sample]:
        out = [
            Sample(c.EXPORTER_COLLECTOR_SUCCESS, labels, float(self.success)),
            Sample(c.EXPORTER_COLLECTOR_DURATION_SECONDS, labels, self.duration),
        ]
        if self.last_success is not None:
            out.append(Sample(c.EXPORTER_LAST_SUCCESS_TIMESTAMP_SECONDS, labels, self.last_success))
        out += [Sample(c.EXPORTER_ERRORS_TOTAL, {**labels, "reason": r}, n) for r, n in self.errors.items()]
        return out


@dataclass
class Poll:
    """One source in the loop. `into(snapshot, ts)` hands the snapshot (None after a failure) to
    the poll state; `labels` tell its health series apart (e.g. {"target": "a:8000"}). `offload`
    runs `into` in a worker thread, for snapshots that take long to apply (a burst of KV events),
    so scrapes keep being answered meanwhile; it touches only its own part of the state."""

    source: Source[Any]
    into: Callable[[Any, float], None]
    labels: dict[str, str] = field(default_factory=dict)
    health: Health = field(default_factory=Health)
    offload: bool = False
    collector: str = field(init=False)  # the source's name, read once: a source without one fails here
    busy: bool = field(default=False, init=False)  # its `into` runs in a worker thread now
    title: str = field(init=False)
    _deadline: Deadline = field(default_factory=Deadline, init=False, repr=False)

    def __post_init__(self) -> None:
        self.collector = self.source.name
        self.title = " ".join([self.collector, *self.labels.values()])  # for log lines: "vllm a:8000"

    def due(self) -> bool:
        """Whether to run this poll: a source with nothing new to say (e.g. a settled discovery,
        kv_event_streams.PacedDiscovery) has a `due()` that says so, and costs no poll meanwhile."""
        due = getattr(self.source, "due", None)
        return due is None or due()

    async def run(self, clock: Callable[[], float], deadline: float) -> None:
        """One collect, at most `deadline` seconds: a hung source costs its own series, not the loop."""
        started = clock()
        error, snapshot = None, None
        try:
            async with self._deadline.within(deadline):  # no task of its own, as wait_for makes
                snapshot = await self.source.collect()
        except TimeoutError:
            error = SourceError("timeout", f"no snapshot within {deadline:g}s")
        except SourceError as err:
            error = err
        except Exception as err:  # the loop outlives any bug in a source
            error = self.health.crashed(self.title, err)
        ended = clock()
        try:
            if self.offload:
                self.busy = True
                try:
                    await asyncio.to_thread(self.into, snapshot, ended)
                finally:
                    self.busy = False
            else:
                self.into(snapshot, ended)
        except Exception as err:
            error, snapshot = self.health.crashed(self.title, err), None
        self.health.record(self.title, started, ended, error)

    def samples(self) -> list[Sample]:
        return self.health.samples({**self.labels, "collector": self.collector})

    async def close(self) -> None:
        await self.source.close()


async def unless_stopped(work: Awaitable[None], stop: asyncio.Event) -> bool:
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


class Exporter:
    """The poll engine of both servers: polls -> state -> a derivation table -> samples.

    `serve` passes a fixed list of polls; `aggregate` passes `discovery` (polls run first: where the
    replicas are), `refresh` (the polls of this round, as discovery finds replicas come and go),
    `limit` (how many polls run at once: its open-file budget) and `drain` (work after the polls and
    every `drain_every` seconds between them: its KV events).
    Either way each poll has the deadline, crash isolation and health series of `Poll.run`, and a
    crash anywhere else is an `internal_error` of collector="derive", never the loop's end."""

    def __init__(
        self,
        polls: Sequence[Poll],
        state: Any,
        options: Any,
        *,
        interval: float,
        clock: Callable[[], float] = time.time,
        derivations: Mapping[str, Callable[[Any, Any], list[Sample]]] = DERIVATIONS,
        deadline: float | None = None,
        discovery: Sequence[Poll] = (),
        refresh: Callable[[], Awaitable[Sequence[Poll]]] | None = None,
        limit: Callable[[], int] | None = None,
        drain: Callable[[], Awaitable[None]] | None = None,
        drain_every: float = 0.25,
        up: Callable[[], bool] | None = None,
    ):
        self.polls = list(polls)
        self.discovery = list(discovery)
        self.state = state
        self.options = options
        self.interval = interval
        self.clock = clock
        self.derivations = derivations
        self.deadline = deadline or max(2 * interval, 10.0)  # per source and poll
        self.refresh, self.limit, self.drain, self.drain_every = refresh, limit, drain, drain_every
        self.up = up or (lambda: any(t.up for t in self.state.targets))
        self.derive_health = Health()  # errors of the derivations themselves: collector="derive"
        self.guard = Guard()
        self._failing: set[str] = set()
        self._poll_problem: str | None = None
        self.ready = False
        self._samples: list[Sample] = []
        self._derived = True  # _samples are of the state as it is now

    @property
    def latest(self) -> list[Sample]:
        """The samples of the state as it is, derived at the first read after a poll (mid-poll: with
        the sources ingested so far). While a part is updated in a worker thread, the last derived."""
        if not self._derived and not any(poll.busy for poll in self.polls):
            self._samples, self._derived = self.derive(), True
        return self._samples

    @latest.setter
    def latest(self, samples: list[Sample]) -> None:
        self._samples, self._derived = samples, True

    async def poll_once(self) -> None:
        try:
            if self.discovery:
                await asyncio.gather(*(poll.run(self.clock, self.deadline) for poll in self.discovery))
            if self.refresh is not None:
                self.polls = list(await self.refresh())
            due = [poll for poll in self.polls if poll.due()]
            if self.limit is None and len(due) == 1:  # the usual sidecar's poll: no task to make
                await due[0].run(self.clock, self.deadline)
            else:
                slots = asyncio.Semaphore(self.limit()) if self.limit is not None else None
                await asyncio.gather(*(self._run(poll, slots) for poll in due))
            if self.drain is not None:
                await self.drain()
            self.state.end_poll(self.clock())
        finally:
            self._derived = False
        self.ready = self.ready or self.up()

    async def _run(self, poll: Poll, slots: asyncio.Semaphore | None) -> None:
        if slots is None:
            return await poll.run(self.clock, self.deadline)
        async with slots:  # the deadline starts once a slot is free
            await poll.run(self.clock, self.deadline)

    def derive(self) -> list[Sample]:
        out: list[Sample] = []
        for poll in (*self.discovery, *self.polls):
            out += poll.samples()
        for name, derivation in self.derivations.items():
            try:
                out += derivation(self.state, self.options)
                self._failing.discard(name)
            except Exception as err:  # one broken derivation costs its own series, not /metrics
                error = self.crashed(f"derive {name}", err)
                if name not in self._failing:  # one line while it keeps failing
                    self._failing.add(name)
                    log.warning(
                        "derivation failed: %s", error, extra={"collector": "derive", "derivation": name}
                    )
        kept = self.guard.filter(out)
        return kept + self._derive_errors()

    def crashed(self, where: str, err: BaseException) -> SourceError:
        """A bug outside any poll (a derivation, a drain): counted as collector="derive"."""
        error = self.derive_health.crashed(where, err)
        self.derive_health.errors[error.reason] += 1
        return error

    def _derive_errors(self) -> list[Sample]:
        errors = self.derive_health.errors + self.guard.errors
        return [
            Sample(c.EXPORTER_ERRORS_TOTAL, {"collector": "derive", "reason": r}, n)
            for r, n in errors.items()
        ]

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every `interval` until `stop` is set; a slow poll delays the next, never overlaps it,
        and a stop mid-poll ends it at once (1,000 replicas' poll is not worth waiting for)."""
        if not stop.is_set():
            await unless_stopped(self._polls(), stop)

    async def _polls(self) -> None:
        """The loop `run` cancels when stopped: one task for all polls, plain sleeps between them
        (a sidecar's poll is ~1 ms of CPU: a task, a wait and a timeout's exception a poll were a
        tenth of it)."""
        while True:
            started = time.monotonic()
            try:
                await self.poll_once()
            except Exception as err:  # nothing above should raise; if it does, keep serving
                error = self.crashed("poll", err)
                if str(error) != self._poll_problem:
                    self._poll_problem = str(error)
                    log.warning("poll failed: %s", error, extra={"collector": "poll"})
            while (delay := self.interval - (time.monotonic() - started)) > 0:
                await asyncio.sleep(delay if self.drain is None else min(delay, self.drain_every))
                await self._drain_between()

    async def _drain_between(self) -> None:
        if self.drain is None:
            return
        try:
            await self.drain()
        except Exception as err:  # a bug in a drain costs that drain, not the loop
            self.crashed("drain", err)

    async def close(self) -> None:
        _ = self.latest  # the last poll's page stays what it was with its sources open
        for poll in (*self.discovery, *self.polls):
            try:
                await poll.close()
            except Exception as err:  # one source failing to close must not leak the others
                log.warning("closing %s failed: %s", poll.title, err)


def target_polls(state: PollState, sources: dict[str, Source[Any]]) -> list[Poll]:
    """One Poll per vLLM target (name -> source); with several, each carries a `target` label."""
    polls = []
    for name, source in sources.items():
        labels = {"target": name} if len(sources) > 1 else {}
        polls.append(Poll(source, state.add_target(name, labels).ingest, labels))
    return polls
