"""GPU memory against the budget vLLM was given, the headroom left to neighbours, and its swing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .. import catalog as c
from ..durations import window_label
from ..samples import Sample
from ..sources.gpu import GpuDevice, GpuSnapshot
from .cache_config import config_number
from .gpu import device_labels
from .state import PollState


def memory_budget_bytes(gpu_memory_utilization: float | None, total_bytes: float | None) -> float | None:
    """vLLM may use gpu_memory_utilization x total (weights, activations and KV cache together)."""
    if gpu_memory_utilization is None or total_bytes is None or gpu_memory_utilization <= 0:
        return None
    return gpu_memory_utilization * total_bytes


def budget_usage_ratio(used_bytes: float | None, budget_bytes: float | None) -> float | None:
    """Above 1: the GPU holds more than vLLM's budget, so something else is on it too."""
    if used_bytes is None or not budget_bytes or budget_bytes <= 0:
        return None
    return used_bytes / budget_bytes


def headroom_ratio(used_bytes: float | None, total_bytes: float | None) -> float | None:
    if used_bytes is None or not total_bytes or total_bytes <= 0:
        return None
    return min(max((total_bytes - used_bytes) / total_bytes, 0.0), 1.0)


def memory_swing_bytes(
    points: Sequence[tuple[float, float]], window_seconds: float, now: float | None = None
) -> float | None:
    """max(used) - min(used) over the (ts, used) points in (now - window, now]; None under two points."""
    if not points:
        return None
    end = points[-1][0] if now is None else now
    used = [value for ts, value in points if end - window_seconds < ts <= end]
    return max(used) - min(used) if len(used) >= 2 else None


SHARED_MIN_FRACTION = 0.02
"""Memory not vLLM's, or a swing, above this share of the GPU means someone shares it (below: driver
reservations and allocator noise)."""


@dataclass(frozen=True)
class GpuSharing:
    """What the GPUs under vLLM show over one window."""

    shared: bool
    """Another process holds memory, or used memory swings (vLLM preallocates and stays flat)."""
    headroom_covers_swing: bool
    """The lowest free memory in the window is at least the window's swing: a neighbour can swing again."""


def neighbour_bytes(device: GpuDevice, budget_bytes: float | None) -> float | None:
    """Memory that is not vLLM's: every process but the largest (NVML's list), else used beyond vLLM's
    budget (DCGM, or no permission to list processes)."""
    held = [p.used_bytes for p in device.processes if p.used_bytes is not None]
    if len(held) >= 2:
        return sum(held) - max(held)
    if device.memory_used_bytes is None or budget_bytes is None:
        return None
    return max(device.memory_used_bytes - budget_bytes, 0.0)


def gpu_sharing(
    snapshot: GpuSnapshot | None,
    now: float,
    gpu_memory_utilization: float | None,
    used_history: Mapping[str, Sequence[tuple[float, float]]],
    window_seconds: float,
) -> GpuSharing | None:
    """None without memory telemetry; shared if any GPU is, headroom covers the swing if it does on all."""
    if snapshot is None:
        return None
    shared, covered, known = False, True, False
    for device in snapshot.devices:
        total = device.memory_total_bytes
        points = [(ts, used) for ts, used in used_history.get(device.uuid, ()) if ts > now - window_seconds]
        if not total or device.memory_used_bytes is None:
            continue
        known = True
        neighbours = neighbour_bytes(device, memory_budget_bytes(gpu_memory_utilization, total))
        swing = memory_swing_bytes(points, window_seconds, now) or 0.0
        peak = max([used for _, used in points] + [device.memory_used_bytes])
        shared |= (neighbours or 0.0) > SHARED_MIN_FRACTION * total or swing > SHARED_MIN_FRACTION * total
        covered &= total - peak >= swing
    return GpuSharing(shared, covered) if known else None


def memory_samples(
    snapshot: GpuSnapshot,
    now: float,
    gpu_memory_utilization: float | None,
    used_history: Mapping[str, Sequence[tuple[float, float]]],
    window: str,
    window_seconds: float,
) -> list[Sample]:
    """The memory group for every GPU; used_history maps a GPU UUID to its (ts, used bytes) points."""
    samples = []
    for device in snapshot.devices:
        labels = device_labels(device)
        budget = memory_budget_bytes(gpu_memory_utilization, device.memory_total_bytes)
        swing = memory_swing_bytes(used_history.get(device.uuid, ()), window_seconds, now)
        values = (
            (c.GPU_MEMORY_BUDGET_BYTES, labels, budget),
            (
                c.GPU_MEMORY_BUDGET_USAGE_RATIO,
                labels,
                budget_usage_ratio(device.memory_used_bytes, budget),
            ),
            (
                c.GPU_MEMORY_HEADROOM_RATIO,
                labels,
                headroom_ratio(device.memory_used_bytes, device.memory_total_bytes),
            ),
            (c.GPU_MEMORY_SWING_BYTES, {**labels, "window": window}, swing),
        )
        samples.extend(Sample(name, lbls, value) for name, lbls, value in values if value is not None)
    return samples


def memory_over(state: PollState, windows: Sequence[float]) -> list[Sample]:
    """The memory group against the first gpu_memory_utilization any target reports; swing per window."""
    snapshot = state.gpu_snapshot
    if snapshot is None or state.gpu is None:
        return []
    utilization = next(
        (
            value
            for target in state.targets
            if target.snapshot
            for config in target.snapshot.cache_configs.values()
            if (value := config_number(config, "gpu_memory_utilization")) is not None
        ),
        None,
    )
    out, used = [], state.gpu.history.used()
    for i, seconds in enumerate(windows):
        samples = memory_samples(snapshot, state.gpu.ts, utilization, used, window_label(seconds), seconds)
        out += samples if i == 0 else [s for s in samples if s.name == c.GPU_MEMORY_SWING_BYTES]
    return out
