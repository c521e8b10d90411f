"""GPU telemetry: its history across polls (used memory, reset-adjusted energy, power) and its samples."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .. import catalog as c
from ..samples import Sample
from ..sources.gpu import GpuDevice, GpuSnapshot
from .windows import advance

_DEVICE_METRICS = (
    (c.GPU_MEMORY_USED_BYTES, "memory_used_bytes"),
    (c.GPU_MEMORY_TOTAL_BYTES, "memory_total_bytes"),
    (c.GPU_UTILIZATION_RATIO, "utilization_ratio"),
    (c.GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO, "memory_utilization_ratio"),
    (c.GPU_POWER_WATTS, "power_watts"),
    (c.GPU_ENERGY_JOULES_TOTAL, "energy_joules"),
    (c.GPU_TEMPERATURE_CELSIUS, "temperature_celsius"),
)


def device_labels(device: GpuDevice) -> dict[str, str]:
    return {"gpu": str(device.index), "uuid": device.uuid, "name": device.name}


def gpu_samples(snapshot: GpuSnapshot) -> list[Sample]:
    samples = []
    for device in snapshot.devices:
        labels = device_labels(device)
        for metric, attribute in _DEVICE_METRICS:
            value = getattr(device, attribute)
            if value is not None:
                samples.append(Sample(metric, labels, float(value)))
        for process in device.processes:
            if process.used_bytes is not None:
                process_labels = {
                    "gpu": labels["gpu"],
                    "uuid": device.uuid,
                    "pid": str(process.pid),
                    "process": process.name,
                }
                samples.append(Sample(c.GPU_PROCESS_MEMORY_USED_BYTES, process_labels, process.used_bytes))
    return samples


@dataclass(frozen=True)
class GpuPoint:
    ts: float
    used: float | None
    energy_total: float | None  # reset-adjusted running total, joules
    power: float | None


class GpuHistory:
    """Per GPU (by UUID): used memory, energy and power over the retention."""

    def __init__(self, retention: float):
        self.retention = retention
        self.points: dict[str, deque[GpuPoint]] = {}
        self._raw_energy: dict[str, float] = {}

    def ingest(self, snapshot: GpuSnapshot, ts: float) -> None:
        for device in snapshot.devices:
            points = self.points.setdefault(device.uuid, deque())
            total = None
            if device.energy_joules is not None:
                previous_total = (
                    points[-1].energy_total if points and points[-1].energy_total is not None else 0.0
                )
                total = advance(
                    self._raw_energy.get(device.uuid), previous_total, device.energy_joules, False
                )
                self._raw_energy[device.uuid] = device.energy_joules
            points.append(GpuPoint(ts, device.memory_used_bytes, total, device.power_watts))
            while points and points[0].ts < ts - self.retention:
                points.popleft()

    def used(self) -> dict[str, list[tuple[float, float]]]:
        return {
            uuid: [(p.ts, p.used) for p in pts if p.used is not None] for uuid, pts in self.points.items()
        }

    def energy_increase(self, seconds: float, now: float) -> float | None:
        total, found = 0.0, False
        for points in self.points.values():
            inside = [p for p in points if p.ts >= now - seconds and p.energy_total is not None]
            if len(inside) >= 2:
                total += inside[-1].energy_total - inside[0].energy_total
                found = True
        return total if found else None

    def mean_power(self, seconds: float, now: float) -> float | None:
        means = []
        for points in self.points.values():
            watts = [p.power for p in points if p.ts >= now - seconds and p.power is not None]
            if watts:
                means.append(sum(watts) / len(watts))
        return sum(means) if means else None
