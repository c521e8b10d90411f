"""What the GPU source (NVML or dcgm-exporter) declares beside its code: its catalog entries (GPU
telemetry; the GPU memory against vLLM's budget), its options, its settings and their checks.
catalog.py and config.py concatenate them in their place; server.ROWS wires it (gpu_factory.wire)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..metric import GPU, entry
from ..options import Option, at_least, choice, duration, http_url

OPTIONS = (
    Option("gpu.source", choice("auto", "nvml", "dcgm", "none"), "auto", "GPU telemetry source"),
    Option("gpu.devices", str, [], "NVML devices to watch, by index or UUID (default: all visible)", True),
    Option("gpu.dcgm_url", http_url, None, "dcgm-exporter /metrics URL (gpu.source=dcgm)"),
    Option("gpu.dcgm_timeout", duration, 5.0, "timeout of one poll of dcgm-exporter"),
    Option("gpu.pod", str, None, "keep the DCGM series of this pod (default: $POD_NAME)"),
    Option("gpu.namespace", str, None, "namespace of that pod (default: $POD_NAMESPACE)"),
    Option("gpu.uuids", str, [], "keep the DCGM series of these GPU UUIDs", True),
    Option("gpu.max_processes", at_least(0), 8, "per-process GPU memory series per GPU, at most"),
)


@dataclass(frozen=True)
class GpuSettings:
    """One field per option above (config.resolve fills them; Settings has them)."""

    gpu_source: str
    gpu_devices: list[str]
    gpu_dcgm_url: str | None
    gpu_dcgm_timeout: float
    gpu_pod: str | None
    gpu_namespace: str | None
    gpu_uuids: list[str]
    gpu_max_processes: int


def from_environment(values: dict[str, Any], environ: dict[str, str]) -> None:
    """Kubernetes' downward API names the pod when no option does."""
    values["gpu.pod"] = values["gpu.pod"] or environ.get("POD_NAME")
    values["gpu.namespace"] = values["gpu.namespace"] or environ.get("POD_NAMESPACE")


def checks(s: GpuSettings) -> list[tuple[str, str]]:
    out = []
    if s.gpu_source == "dcgm" and not s.gpu_dcgm_url:
        out.append(("--gpu.dcgm-url", "needed with --gpu.source=dcgm"))
    dcgm = s.gpu_source == "dcgm" or (s.gpu_source == "auto" and s.gpu_dcgm_url)
    if dcgm and not s.gpu_pod and not s.gpu_uuids:
        out.append(("--gpu.pod", "the dcgm GPU source needs this pod's name ($POD_NAME) or --gpu.uuids"))
    return out


def timeout(s: GpuSettings) -> float:
    return s.gpu_dcgm_timeout + 1


GPU_MEMORY_USED_BYTES = "kvcache_gpu_memory_used_bytes"
GPU_MEMORY_TOTAL_BYTES = "kvcache_gpu_memory_total_bytes"
GPU_UTILIZATION_RATIO = "kvcache_gpu_utilization_ratio"
GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO = "kvcache_gpu_memory_bandwidth_utilization_ratio"
GPU_POWER_WATTS = "kvcache_gpu_power_watts"
GPU_ENERGY_JOULES_TOTAL = "kvcache_gpu_energy_joules_total"
GPU_TEMPERATURE_CELSIUS = "kvcache_gpu_temperature_celsius"
GPU_PROCESS_MEMORY_USED_BYTES = "kvcache_gpu_process_memory_used_bytes"
GPU_MEMORY_BUDGET_BYTES = "kvcache_gpu_memory_budget_bytes"
GPU_MEMORY_BUDGET_USAGE_RATIO = "kvcache_gpu_memory_budget_usage_ratio"
GPU_MEMORY_HEADROOM_RATIO = "kvcache_gpu_memory_headroom_ratio"
GPU_MEMORY_SWING_BYTES = "kvcache_gpu_memory_swing_bytes"

METRICS = (
    entry(GPU_MEMORY_USED_BYTES, "gauge", "GPU memory in use.", GPU, "bytes", "gpu", "NVML or DCGM"),
    entry(GPU_MEMORY_TOTAL_BYTES, "gauge", "GPU memory in total.", GPU, "bytes", "gpu", "NVML or DCGM"),
    entry(
        GPU_UTILIZATION_RATIO,
        "gauge",
        "GPU (SM) utilization, 0-1.",
        GPU,
        "ratio",
        "gpu",
        "NVML or DCGM",
    ),
    entry(
        GPU_MEMORY_BANDWIDTH_UTILIZATION_RATIO,
        "gauge",
        "Memory-controller utilization, 0-1.",
        GPU,
        "ratio",
        "gpu",
        "NVML or DCGM",
    ),
    entry(GPU_POWER_WATTS, "gauge", "Power draw.", GPU, "watts", "gpu", "NVML or DCGM"),
    entry(
        GPU_ENERGY_JOULES_TOTAL,
        "counter",
        "Energy consumed since the driver loaded.",
        GPU,
        "joules",
        "gpu",
        "NVML total energy (mJ) or DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION (mJ)",
        "mJ / 1000",
    ),
    entry(GPU_TEMPERATURE_CELSIUS, "gauge", "GPU temperature.", GPU, "celsius", "gpu", "NVML or DCGM"),
    entry(
        GPU_PROCESS_MEMORY_USED_BYTES,
        "gauge",
        "GPU memory used per process (bounded: vLLM processes or the top N).",
        ("gpu", "uuid", "pid", "process"),
        "bytes",
        "gpu",
        "NVML running compute processes",
    ),
    entry(
        GPU_MEMORY_BUDGET_BYTES,
        "gauge",
        "GPU memory vLLM was told it may use.",
        GPU,
        "bytes",
        "memory",
        "vllm:cache_config_info{gpu_memory_utilization}, GPU total memory",
        "gpu_memory_utilization x total",
    ),
    entry(
        GPU_MEMORY_BUDGET_USAGE_RATIO,
        "gauge",
        "GPU memory used over the budget vLLM was given; above 1 means something else uses the GPU too.",
        GPU,
        "ratio",
        "memory",
        "GPU used memory, kvcache_gpu_memory_budget_bytes",
        "used / budget",
        allowed=(0.0, math.inf),  # above 1 is the finding, not an error
    ),
    entry(
        GPU_MEMORY_HEADROOM_RATIO,
        "gauge",
        "Share of GPU memory still free for co-located processes.",
        GPU,
        "ratio",
        "memory",
        "GPU used and total memory",
        "(total - used) / total",
    ),
    entry(
        GPU_MEMORY_SWING_BYTES,
        "gauge",
        "Largest minus smallest GPU memory in use over the window.",
        (*GPU, "window"),
        "bytes",
        "memory",
        "GPU used memory history",
        "max(used) - min(used) over the window",
    ),
)
