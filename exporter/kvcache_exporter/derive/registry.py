"""Every derivation of one poll, each a pure function of the poll state and the options.

The poll loop runs them one by one, so a bug in one (an `internal_error`) costs only its own series.
`serve` takes them from its rows (server.ROWS names each beside its source, in this order:
tests/core/test_kit.py checks the two agree); DERIVATIONS is the engine's default table.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..durations import window_label
from ..samples import Sample
from .audit import DEFAULT_GPU_MEMORY_UTILIZATION_CEILING, audit_samples
from .cache_config import block_bytes
from .cost import Pricing, cost_samples
from .gpu import gpu_samples
from .kv_events import kv_event_samples
from .memory import memory_over
from .miss_windows import excess_tokens, memory_samples, miss_samples
from .state import PollState
from .targets import target_samples
from .unit_samples import unit_samples


@dataclass(frozen=True)
class DeriveOptions:
    windows: tuple[float, ...] = (60.0,)  # ascending
    quantiles: tuple[float, ...] = (0.5,)
    pricing: Pricing = field(default_factory=Pricing)
    gpu_count: int = 1  # GPUs priced when no GPU source reports any
    gpu_memory_utilization_ceiling: float = DEFAULT_GPU_MEMORY_UTILIZATION_CEILING


def targets(state: PollState, options: DeriveOptions) -> list[Sample]:
    return [s for t in state.targets for s in target_samples(t, options.windows, options.quantiles)]


def kv_events(state: PollState, options: DeriveOptions) -> list[Sample]:
    return [s for part in state.kv_events for s in kv_event_samples(part.events, part.labels)]


def attribution(state: PollState, options: DeriveOptions) -> list[Sample]:
    """Miss attribution, its windows joined with its target's /metrics (KvEventsState.target): a
    stream labelled engine=r (one data-parallel rank) with that engine's series only."""
    windows = [(seconds, window_label(seconds)) for seconds in options.windows]
    out: list[Sample] = []
    for part in state.kv_events:
        if part.attribution is None or part.misses is None:
            continue
        samples = miss_samples(part.attribution.totals, part.misses, windows, part.vllm_window)
        part.report_excess(excess_tokens(samples))  # the one side effect: a rate-limited log line
        samples += memory_samples(part.attribution.tracked, part.attribution.limits)
        if part.attribution.fields is not None:
            samples += part.attribution.fields.samples()
        if part.units is not None:
            samples += unit_samples(part.units, block_bytes(part.cache_config()))
        out += [s._replace(labels={**s.labels, **part.labels}) for s in samples] if part.labels else samples
    return out


def gpu(state: PollState, options: DeriveOptions) -> list[Sample]:
    snapshot = state.gpu_snapshot
    return [] if snapshot is None else gpu_samples(snapshot) + memory_over(state, options.windows)


def cost(state: PollState, options: DeriveOptions) -> list[Sample]:
    return cost_samples(state, options.pricing, options.gpu_count, options.windows)


def audit(state: PollState, options: DeriveOptions) -> list[Sample]:
    return audit_samples(state, options.gpu_memory_utilization_ceiling, options.windows)


Derivation = Callable[[PollState, DeriveOptions], list[Sample]]
DERIVATIONS: dict[str, Derivation] = {
    "targets": targets,
    "kv_events": kv_events,
    "attribution": attribution,
    "gpu": gpu,
    "cost": cost,
    "audit": audit,
}
