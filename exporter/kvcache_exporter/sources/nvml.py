"""GPU telemetry read through NVML (nvidia-ml-py), off the event loop.

Run `python -m kvcache_exporter.sources.nvml` to print one snapshot as JSON.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import pynvml

from .base import SourceError, SourceUnavailable
from .gpu import GpuDevice, GpuProcess, GpuSnapshot

_ABSENT = {pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED}
_REASONS = {
    pynvml.NVML_ERROR_GPU_IS_LOST: "gpu_lost",
    pynvml.NVML_ERROR_RESET_REQUIRED: "gpu_reset_required",
    pynvml.NVML_ERROR_TIMEOUT: "nvml_timeout",
    pynvml.NVML_ERROR_NO_PERMISSION: "nvml_no_permission",
    pynvml.NVML_ERROR_NOT_FOUND: "gpu_not_found",
    pynvml.NVML_ERROR_GPU_NOT_FOUND: "gpu_not_found",
}
_PREFERRED_PROCESSES = ("vllm", "python")


def _translate(error: pynvml.NVMLError) -> SourceError:
    if error.value in _ABSENT:
        return SourceUnavailable(f"NVML unavailable: {error}")
    return SourceError(_REASONS.get(error.value, "nvml_error"), f"NVML: {error}")


def _optional(read: Callable[..., Any], *args: Any) -> Any:
    """A field this GPU or driver does not support is omitted, not a failure."""
    try:
        return read(*args)
    except pynvml.NVMLError_NotSupported:
        return None


def select_processes(processes: Sequence[GpuProcess], limit: int) -> tuple[GpuProcess, ...]:
    """vLLM/Python processes first, then the largest; at most `limit` so the pid label stays bounded."""

    def rank(process: GpuProcess) -> tuple[bool, float]:
        preferred = any(word in process.name.lower() for word in _PREFERRED_PROCESSES)
        return (not preferred, -(process.used_bytes or 0))

    return tuple(sorted(processes, key=rank)[: max(limit, 0)])


def _process_name(pid: int) -> str:
    try:
        return pynvml.nvmlSystemGetProcessName(pid).rsplit("/", 1)[-1]
    except (pynvml.NVMLError_NotFound, pynvml.NVMLError_NoPermission, pynvml.NVMLError_NotSupported):
        return ""  # a process in another PID namespace: NVML knows its pid, not its name


def _processes(handle: Any, limit: int) -> tuple[GpuProcess, ...]:
    if limit <= 0:
        return ()
    running = _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    found = [GpuProcess(p.pid, _process_name(p.pid), p.usedGpuMemory) for p in running]
    return select_processes(found, limit)


def _per_thousand(value: float | None) -> float | None:
    return None if value is None else value / 1000


def read_device(handle: Any, max_processes: int) -> GpuDevice:
    memory = _optional(pynvml.nvmlDeviceGetMemoryInfo, handle)
    rates = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    return GpuDevice(
        index=pynvml.nvmlDeviceGetIndex(handle),
        uuid=pynvml.nvmlDeviceGetUUID(handle),
        name=pynvml.nvmlDeviceGetName(handle),
        memory_used_bytes=None if memory is None else float(memory.used),
        memory_total_bytes=None if memory is None else float(memory.total),
        utilization_ratio=None if rates is None else rates.gpu / 100,
        memory_utilization_ratio=None if rates is None else rates.memory / 100,
        power_watts=_per_thousand(_optional(pynvml.nvmlDeviceGetPowerUsage, handle)),
        energy_joules=_per_thousand(_optional(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle)),
        temperature_celsius=_optional(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        processes=_processes(handle, max_processes),
    )


class NvmlSource:
    """devices: GPU indexes or UUIDs (default: every visible GPU); max_processes: per GPU."""

    name = "gpu"

    def __init__(
        self,
        devices: Sequence[str | int] = (),
        max_processes: int = 8,
    ):
        self.devices = tuple(str(d) for d in devices)
        self.max_processes = max_processes
        self._initialized = False

    def available(self) -> bool:
        try:
            self._init()
        except SourceError:
            return False
        return True

    def _init(self) -> None:
        if self._initialized:
            return
        try:
            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() == 0:
                pynvml.nvmlShutdown()
                raise SourceUnavailable("NVML sees no GPU")
        except pynvml.NVMLError as error:
            raise _translate(error) from error
        self._initialized = True

    def _handles(self) -> list[Any]:
        if not self.devices:
            return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return [
            pynvml.nvmlDeviceGetHandleByIndex(int(d)) if d.isdigit() else pynvml.nvmlDeviceGetHandleByUUID(d)
            for d in self.devices
        ]

    def read(self) -> GpuSnapshot:
        """Blocking: one snapshot. After an NVML error the next call initializes NVML again."""
        self._init()
        try:
            devices = tuple(read_device(h, self.max_processes) for h in self._handles())
        except pynvml.NVMLError as error:
            self.release()
            raise _translate(error) from error
        return GpuSnapshot(devices)

    async def collect(self) -> GpuSnapshot:
        return await asyncio.to_thread(self.read)

    async def close(self) -> None:
        self.release()

    def release(self) -> None:
        """Shut NVML down (idempotent); the next collect initializes it again."""
        if self._initialized:
            self._initialized = False
            try:
                pynvml.nvmlShutdown()
            except pynvml.NVMLError:
                pass  # a lost GPU may refuse a clean shutdown; init starts over anyway


def main() -> int:
    import dataclasses
    import json
    import sys

    source = NvmlSource(devices=sys.argv[1:])
    try:
        snapshot = source.read()
    except SourceError as error:
        print(json.dumps({"error": error.reason, "message": str(error)}))
        return 1
    finally:
        source.release()
    print(json.dumps(dataclasses.asdict(snapshot), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
