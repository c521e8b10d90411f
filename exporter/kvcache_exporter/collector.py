"""The poll loop: sources -> history -> derivations -> the samples /metrics renders.

The exporter polls on its own cadence so that windowed measures never depend on who
scrapes it or how often. One failing source never fails the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from .config import window_label
from .derive import cache
from .derive.windows import SeriesHistory
from .sources.base import Sample, SourceError, SourceUnavailable
from .sources.vllm import VllmSnapshot, VllmSource

log = logging.getLogger("kvcache_exporter")


@dataclass
class Health:
    """What the exporter says about one collector."""

    success: bool = False
    duration: float = 0.0
    last_success: float | None = None
    errors: Counter[str] = field(default_factory=Counter)
    last_problem: str | None = None

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

    def samples(self, labels: dict[str, str]) -> list[Sample]:
        out = [
            Sample("kvcache_exporter_collector_success", labels, float(self.success)),
            Sample("kvcache_exporter_collector_duration_seconds", labels, self.duration),
        ]
        if self.last_success is not None:
            out.append(Sample("kvcache_exporter_last_success_timestamp_seconds", labels, self.last_success))
        out += [
            Sample("kvcache_exporter_errors_total", {**labels, "reason": r}, n)
            for r, n in self.errors.items()
        ]
        return out


class Target:
    """One vLLM server and the history of its engines."""

    def __init__(self, name: str, source: VllmSource, retention: float):
        self.name = name
        self.source = source
        self.retention = retention
        self.histories: dict[tuple[str, str], SeriesHistory] = {}
        self.snapshot: VllmSnapshot | None = None
        self.up = False
        self.health = Health()

    def ingest(self, snapshot: VllmSnapshot) -> None:
        for key, sample in snapshot.engines.items():
            self.histories.setdefault(key, SeriesHistory(self.retention)).append(snapshot.ts, sample)
        for key in list(self.histories):  # engines gone for longer than the retention are forgotten
            points = self.histories[key].points
            if key not in snapshot.engines and (not points or points[-1].ts < snapshot.ts - self.retention):
                del self.histories[key]
        self.snapshot = snapshot


Extra = Callable[["Exporter"], list[Sample]]


class Exporter:
    def __init__(
        self,
        targets: list[Target],
        *,
        windows: list[float],
        quantiles: list[float],
        interval: float,
        clock: Callable[[], float] = time.time,
        extras: list[Extra] | None = None,
        pollers: dict[str, Callable[[], Awaitable[Any]]] | None = None,
        closers: list[Callable[[], Any]] | None = None,
    ):
        self.targets = targets
        self.windows = sorted(windows)
        self.quantiles = tuple(quantiles)
        self.interval = interval
        self.clock = clock
        self.extras = extras or []  # derivations that need more than one target (GPU, cost, audit)
        self.pollers = pollers or {}  # other sources, polled beside vLLM: name -> collect()
        self.closers = closers or []
        self.results: dict[str, Any] = {}
        self.health: dict[str, Health] = {name: Health() for name in self.pollers}
        self.ready = False
        self.latest: list[Sample] = []

    @property
    def labelled(self) -> bool:
        return len(self.targets) > 1

    def target_labels(self, target: Target) -> dict[str, str]:
        return {"target": target.name} if self.labelled else {}

    async def _poll_target(self, target: Target) -> None:
        started = self.clock()
        error = None
        try:
            snapshot = await target.source.collect()
            snapshot.ts = self.clock()
            target.ingest(snapshot)
        except SourceError as err:
            error = err
        target.up = error is None
        target.health.record(f"vllm {target.name}", started, self.clock(), error)

    async def _poll_other(self, name: str, collect: Callable[[], Awaitable[Any]]) -> None:
        started = self.clock()
        error = None
        try:
            self.results[name] = await collect()
        except SourceError as err:
            error = err
            self.results.pop(name, None)
        self.health[name].record(name, started, self.clock(), error)

    async def poll_once(self) -> None:
        await asyncio.gather(
            *(self._poll_target(t) for t in self.targets),
            *(self._poll_other(name, collect) for name, collect in self.pollers.items()),
        )
        self.ready = self.ready or any(t.up for t in self.targets)
        self.latest = self.derive()

    def derive(self) -> list[Sample]:
        out: list[Sample] = []
        for target in self.targets:
            out += self._target_samples(target)
        for name, health in self.health.items():
            out += health.samples({"collector": name})
        for extra in self.extras:
            out += extra(self)
        return out

    def _target_samples(self, target: Target) -> list[Sample]:
        base = self.target_labels(target)
        out = [Sample("kvcache_vllm_up", base, float(target.up))]
        out += target.health.samples({**base, "collector": "vllm"})
        snapshot = target.snapshot
        if not target.up or snapshot is None:
            return out  # no stale numbers: derived series vanish while vLLM is unreachable
        out += [
            Sample(
                "kvcache_vllm_schema_info",
                {**base, "schema": snapshot.schema, "prefix": snapshot.prefix},
                1.0,
            ),
            Sample("kvcache_vllm_deprecated_metrics", base, float(len(snapshot.deprecated))),
            Sample("kvcache_vllm_missing_metrics", base, float(len(snapshot.missing))),
        ]
        for (model, engine), sample in snapshot.engines.items():
            labels = {**base, "model_name": model, "engine": engine}
            out += cache.current(labels, sample, snapshot.cache_configs.get(engine))
            history = target.histories.get((model, engine))
            for seconds in self.windows if history else ():
                delta = history.window(seconds)
                if delta is not None:
                    out += cache.windowed(labels, window_label(seconds), delta, self.quantiles)
        return out

    async def run(self, stop: asyncio.Event) -> None:
        """Poll every `interval` until `stop` is set; a slow poll delays the next, never overlaps it."""
        while not stop.is_set():
            started = time.monotonic()
            await self.poll_once()
            delay = max(self.interval - (time.monotonic() - started), 0.0)
            try:
                await asyncio.wait_for(stop.wait(), timeout=delay)
            except TimeoutError:
                pass

    async def close(self) -> None:
        for target in self.targets:
            await target.source.close()
        for closer in self.closers:
            result = closer()
            if asyncio.iscoroutine(result):
                await result
