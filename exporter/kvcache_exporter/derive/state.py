"""The poll state: everything the sources delivered, kept as history for the derivations.

Sources hand snapshots to the `ingest` of one part (a vLLM target, the GPU, a KV-event stream);
derivations (derive/registry.py and the modules it calls) only read it. Ingesting is the one place
state changes, so deriving twice from the same state gives the same samples.

A built-in source has a part here (a dataclass with `ingest(snapshot, ts)`) and a pure function
over it in derive/. A source registered as a row (kit.py) keeps its part in `parts[its name]`,
declared in its own module, so this file is not edited for it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..sources.gpu import GpuSnapshot
from ..sources.kv_events_decode import Batch, Dropped
from ..sources.vllm_snapshot import EngineKey, VllmSnapshot
from .attribution import Attribution
from .gpu import GpuHistory
from .kv_budget import Budget
from .kv_events import EventState, KvEventDrain
from .miss_windows import MissHistory, num_gpu_blocks, summed_window
from .units import UnitView
from .whatif import host_tier_blocks, kv_bytes_per_token
from .windows import Delta, SeriesHistory

log = logging.getLogger(__name__)
EXCESS_LOG_SECONDS = 60.0


@dataclass
class TargetState:
    """One vLLM server and the history of its engines."""

    name: str
    retention: float
    labels: dict[str, str] = field(default_factory=dict)  # {"target": name} when several are polled
    up: bool = False
    snapshot: VllmSnapshot | None = None
    engine_kind: str = "vllm"  # the `engine_kind` label: the flag's, then what the last page was
    histories: dict[EngineKey, SeriesHistory] = field(default_factory=dict)

    def ingest(self, snapshot: VllmSnapshot | None, ts: float) -> None:
        """None: the poll failed. Derived series vanish (no stale numbers); history is kept."""
        self.up = snapshot is not None
        if snapshot is None:
            return
        self.engine_kind = snapshot.engine_kind
        for key, sample in snapshot.engines.items():
            self.histories.setdefault(key, SeriesHistory(self.retention)).append(ts, sample)
        for key in list(self.histories):  # engines gone for longer than the retention are forgotten
            points = self.histories[key].points
            if key not in snapshot.engines and (not points or points[-1].ts < ts - self.retention):
                del self.histories[key]
        self.snapshot = snapshot


@dataclass
class GpuState:
    retention: float
    snapshot: GpuSnapshot | None = None
    ts: float = 0.0  # the poll's time of `snapshot`: one clock for every window
    history: GpuHistory = field(init=False)

    def __post_init__(self) -> None:
        self.history = GpuHistory(self.retention)

    def ingest(self, snapshot: GpuSnapshot | None, ts: float) -> None:
        self.snapshot, self.ts = snapshot, ts
        if snapshot is not None:
            self.history.ingest(snapshot, ts)


@dataclass
class KvEventsState:
    """One KV-event publisher (one data-parallel rank): the batches drained from its subscriber, in
    arrival order, within `budget` seconds a poll (None: no limit; see kv_budget.py). The event view
    reads its sequence (once); each batch goes with that mark, when on, through the group model
    (`units`) to miss attribution, whose totals are kept per poll.

    vLLM's side reaches attribution one way: from `target`, the vLLM this stream belongs to (the one
    it was discovered from or configured beside), read by `join` at the end of each poll (its cache
    sizes) and by the derivation (`vllm_window`, `cache_config`): this rank's engine only."""

    events: EventState = field(default_factory=EventState)
    labels: dict[str, str] = field(default_factory=dict)  # {"engine": rank} with several ranks
    attribution: Attribution | None = None
    misses: MissHistory | None = None
    units: UnitView | None = None
    budget: float | None = None
    clock: Callable[[], float] = time.monotonic
    target: TargetState | None = None
    excess_quiet_until: float = float("-inf")
    carry: tuple[Batch, ...] = ()  # the rest of a batch the last poll's budget ran out in

    def report_excess(self, tokens: float) -> None:
        """Attributed tokens above computed (miss_windows.window_samples): one line a minute at most."""
        now = self.clock()
        if tokens > 0 and now >= self.excess_quiet_until:
            self.excess_quiet_until = now + EXCESS_LOG_SECONDS
            log.warning(
                "KV events attributed %.0f prompt tokens more than vLLM computed%s: coverage and the "
                "what-if estimates are withheld (a broken or hostile publisher; see "
                "kvcache_kv_events_dropped_total)",
                tokens,
                f" (engine {self.labels['engine']})" if "engine" in self.labels else "",
            )

    def ingest(self, drain: KvEventDrain | None, ts: float) -> None:
        attribution = self.attribution if self.misses is not None else None
        if drain is not None or self.carry:
            budget = Budget(self.budget, self.clock, self.carry)
            for part in budget.slices(drain or KvEventDrain()):
                self._apply(part, attribution)
            self.carry = budget.carry
        if attribution is not None and self.misses is not None:
            if self.units is not None:  # loads back from a tier: never passed on, counted apart
                attribution.totals.tier_restored_tokens = sum(self.units.totals.tier_hit_tokens.values())
            self.misses.record(ts, attribution.totals)

    def join(self, host_tier_bytes: int | None) -> None:
        """The what-if estimates need vLLM's cache sizes (its /metrics), the group model's hit unit."""
        attribution = self.attribution
        if attribution is None:
            return
        snapshot = self.target.snapshot if self.target is not None else None
        if capacity := num_gpu_blocks(snapshot):
            attribution.capacity_blocks = capacity
        config = next(iter(snapshot.cache_configs.values()), None) if snapshot is not None else None
        host = host_tier_blocks(config, host_tier_bytes)
        if host is not None:
            attribution.set_host_tier(host, kv_bytes_per_token(config))
        if self.units is not None and self.units.hit_unit:
            attribution.hit_unit = self.units.hit_unit  # what the groups say vLLM hits in

    def vllm_window(self, seconds: float) -> Delta | None:
        """vLLM's counters over the window, of this stream's engine (all engines when unlabelled)."""
        target, engine = self.target, self.labels.get("engine")
        histories = target.histories.items() if target is not None and target.up else ()
        return summed_window([h.window(seconds) for (_, e), h in histories if engine is None or e == engine])

    def cache_config(self) -> dict[str, str] | None:
        snapshot = self.target.snapshot if self.target is not None else None
        return snapshot.cache_configs.get(self.labels.get("engine", "0")) if snapshot is not None else None

    def _apply(self, drain: KvEventDrain, attribution: Attribution | None) -> None:
        units = self.units
        for item in drain.items:
            if isinstance(item, Dropped):
                mark = self.events.drop(item.reason, item.seq, item.count)
                if attribution is not None:
                    attribution.mark(mark)
                continue
            mark = self.events.apply(item)
            if mark.restart and units is not None:
                units.restart()
            if attribution is not None:
                attribution.apply(item if units is None else units.units(item), mark)


class LoadPeaks:
    """Each model's largest load (running + waiting) over the retention, a model absent from a poll
    counting 0 there. Per model only the polls that no later poll matches are kept (a sliding-window
    maximum): a few entries under steady load, not one per poll (3,602 an hour at 1 s)."""

    def __init__(self, retention: float):
        self.retention = retention
        self.last: float | None = None  # the previous poll's time
        self._kept: dict[str, deque[tuple[float, float]]] = {}

    def add(self, now: float, load: dict[str, float]) -> None:
        for model in load.keys() - self._kept.keys():  # the polls before it lacked it: one 0 stands for all
            self._kept[model] = deque() if self.last is None else deque([(self.last, 0.0)])
        for model, kept in list(self._kept.items()):
            value = load.get(model, 0.0)
            while kept and kept[-1][1] <= value:
                kept.pop()
            kept.append((now, value))
            while kept[0][0] < now - self.retention:
                kept.popleft()
            if model not in load and len(kept) == 1:  # its peak is the 0 an unknown model gets
                del self._kept[model]
        self.last = now

    def peak(self, model: str) -> float | None:
        """None before the first poll."""
        kept = self._kept.get(model)
        if kept:
            return kept[0][1]
        return None if self.last is None else 0.0

    def __len__(self) -> int:
        """Entries kept, all models together: what the memory bound is about."""
        return sum(map(len, self._kept.values()))


@dataclass
class PollState:
    retention: float
    targets: list[TargetState] = field(default_factory=list)
    gpu: GpuState | None = None
    kv_events: list[KvEventsState] = field(default_factory=list)
    now: float = 0.0  # when the latest poll ended
    host_tier_bytes: int | None = None  # --whatif.host-tier-bytes (whatif.py)
    parts: dict[str, Any] = field(default_factory=dict)  # a registered source's own part (kit.py)
    load_peaks: LoadPeaks = field(init=False)

    def __post_init__(self) -> None:
        self.load_peaks = LoadPeaks(self.retention)

    def add_target(self, name: str, labels: dict[str, str] | None = None) -> TargetState:
        target = TargetState(name, self.retention, labels or {})
        self.targets.append(target)
        return target

    def add_gpu(self) -> GpuState:
        self.gpu = GpuState(self.retention)
        return self.gpu

    def add_kv_events(
        self,
        events: EventState,
        labels: dict[str, str] | None = None,
        attribution: Attribution | None = None,
        units: UnitView | None = None,
        budget: float | None = None,
        target: TargetState | None = None,
    ) -> KvEventsState:
        """`target`: the vLLM the stream belongs to; None: the only target, when there is one."""
        misses = None if attribution is None else MissHistory(self.retention)
        part = KvEventsState(events, labels or {}, attribution, misses, units, budget, target=target)
        self.kv_events.append(part)
        return part

    @property
    def gpu_snapshot(self) -> GpuSnapshot | None:
        return None if self.gpu is None else self.gpu.snapshot

    def end_poll(self, now: float) -> None:
        """After every source was ingested: the running + waiting load per model, for the audit's peak."""
        self.now = now
        for part in self.kv_events:
            if part.target is None and len(self.targets) == 1:  # a sidecar beside one vLLM
                part.target = self.targets[0]
            part.join(self.host_tier_bytes)
        load: dict[str, float] = {}
        for target in self.targets:
            if target.snapshot is None or not target.up:
                continue
            for (model, _), sample in target.snapshot.engines.items():
                load[model] = (
                    load.get(model, 0.0) + sample.gauges.get("running", 0) + sample.gauges.get("waiting", 0)
                )
        self.load_peaks.add(now, load)
