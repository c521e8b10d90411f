"""GPU telemetry: the snapshot every GPU source returns, its samples, and the source factory.

Measurements a GPU or driver does not support are None and produce no sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from .base import Sample, SourceUnavailable


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
    ts: float
    devices: tuple[GpuDevice, ...]


class GpuSource(Protocol):
    async def collect(self) -> GpuSnapshot: ...

    def close(self) -> None: ...


_DEVICE_METRICS = (
    ("kvcache_gpu_memory_used_bytes", "memory_used_bytes"),
    ("kvcache_gpu_memory_total_bytes", "memory_total_bytes"),
    ("kvcache_gpu_utilization_ratio", "utilization_ratio"),
    ("kvcache_gpu_memory_bandwidth_utilization_ratio", "memory_utilization_ratio"),
    ("kvcache_gpu_power_watts", "power_watts"),
    ("kvcache_gpu_energy_joules_total", "energy_joules"),
    ("kvcache_gpu_temperature_celsius", "temperature_celsius"),
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
                samples.append(
                    Sample("kvcache_gpu_process_memory_used_bytes", process_labels, process.used_bytes)
                )
    return samples


class NoGpuSource:
    """GPU telemetry switched off or impossible here: every collect says so, at debug level."""

    def __init__(self, why: str = "GPU telemetry disabled"):
        self.why = why

    async def collect(self) -> GpuSnapshot:
        raise SourceUnavailable(self.why)

    def close(self) -> None:
        pass


_NVML_OPTIONS = ("devices", "max_processes")
_DCGM_OPTIONS = ("dcgm_url", "pod_name", "pod_namespace", "gpu_uuids", "timeout_seconds", "max_body_bytes")


def _pick(options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: options[name] for name in names if options.get(name) is not None}


def make_gpu_source(kind: str = "auto", **options: Any) -> GpuSource:
    """kind: auto (dcgm if a dcgm_url is given, else NVML if it initializes, else none) | nvml | dcgm | none.

    Options: devices, max_processes (NVML); dcgm_url, pod_name, pod_namespace, gpu_uuids,
    timeout_seconds, max_body_bytes (DCGM). Options of the other kind are ignored.
    """
    if kind == "none":
        return NoGpuSource()
    if kind == "dcgm" or (kind == "auto" and options.get("dcgm_url")):
        from .dcgm import DcgmSource

        if not options.get("dcgm_url"):
            raise ValueError("the dcgm GPU source needs a dcgm-exporter URL")
        dcgm_options = _pick(options, _DCGM_OPTIONS)
        return DcgmSource(dcgm_options.pop("dcgm_url"), **dcgm_options)
    if kind not in ("auto", "nvml"):
        raise ValueError(f"unknown GPU source kind {kind!r} (auto, nvml, dcgm, none)")

    from .nvml import NvmlSource

    source = NvmlSource(**_pick(options, _NVML_OPTIONS))
    if kind == "auto" and not source.available():
        source.close()
        return NoGpuSource("NVML did not initialize (no driver or no GPU visible)")
    return source
