"""GPU memory against the budget vLLM was given, the headroom left to neighbours, and its swing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..sources.base import Sample
from ..sources.gpu import GpuSnapshot, device_labels


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


def memory_samples(
    snapshot: GpuSnapshot,
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
        swing = memory_swing_bytes(used_history.get(device.uuid, ()), window_seconds, snapshot.ts)
        values = (
            ("kvcache_gpu_memory_budget_bytes", labels, budget),
            (
                "kvcache_gpu_memory_budget_usage_ratio",
                labels,
                budget_usage_ratio(device.memory_used_bytes, budget),
            ),
            (
                "kvcache_gpu_memory_headroom_ratio",
                labels,
                headroom_ratio(device.memory_used_bytes, device.memory_total_bytes),
            ),
            ("kvcache_gpu_memory_swing_bytes", {**labels, "window": window}, swing),
        )
        samples.extend(Sample(name, lbls, value) for name, lbls, value in values if value is not None)
    return samples
