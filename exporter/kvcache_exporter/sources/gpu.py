"""GPU telemetry: the snapshot every GPU source returns (NVML, DCGM); the factory is gpu_factory.py.

Measurements a GPU or driver does not support are None and produce no sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    used_bytes: float | None


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str
    name: str
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    utilization_ratio: float | None = None
    memory_utilization_ratio: float | None = None
    power_watts: float | None = None
    energy_joules: float | None = None
    temperature_celsius: float | None = None
    processes: tuple[GpuProcess, ...] = ()


@dataclass(frozen=True)
class GpuSnapshot:
    """What the GPUs show at one poll; the poll stamps it (one clock for every source)."""

    devices: tuple[GpuDevice, ...]


class GpuSource(Protocol):
    name: str

    async def collect(self) -> GpuSnapshot: ...

    async def close(self) -> None: ...
