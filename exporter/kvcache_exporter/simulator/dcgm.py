"""GPU telemetry in dcgm-exporter's text format, driven by the engines' load."""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB_MIB = 1024
FAMILIES = (
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ)."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
)


@dataclass
class GpuState:
    """One simulated GPU; `advance` integrates energy, `render` writes the exposition."""

    index: int
    total_mib: int
    base_used_mib: float
    hostname: str = "sim-node"
    model_name: str = "NVIDIA H100 80GB HBM3"
    energy_mj: float = 0.0
    busy: float = 0.0
    kv_usage: float = 0.0
    swing_period_s: float = 0.0
    elapsed_s: float = 0.0

    @property
    def uuid(self) -> str:
        return f"GPU-5e1a0000-0000-4000-8000-{self.index:012d}"

    def advance(self, seconds: float, busy: float, kv_usage: float) -> None:
        self.elapsed_s += seconds
        self.busy, self.kv_usage = busy, kv_usage
        self.energy_mj += self.power_w * seconds * 1000.0

    @property
    def power_w(self) -> float:
        return 70.0 + 530.0 * self.busy

    @property
    def used_mib(self) -> float:
        if self.swing_period_s > 0:
            # The seed incident: used memory swinging between 12 GB and 20 GB.
            phase = 0.5 - 0.5 * math.cos(2 * math.pi * self.elapsed_s / self.swing_period_s)
            return (12 + 8 * phase) * 1000 * 1000**2 / 1024**2
        return self.base_used_mib

    def values(self) -> dict[str, float]:
        used = min(self.used_mib, self.total_mib)
        return {
            "DCGM_FI_DEV_GPU_TEMP": round(34 + 40 * self.busy),
            "DCGM_FI_DEV_POWER_USAGE": round(self.power_w, 3),
            "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": round(self.energy_mj),
            "DCGM_FI_DEV_GPU_UTIL": round(100 * self.busy),
            "DCGM_FI_DEV_MEM_COPY_UTIL": round(100 * self.busy * (0.3 + 0.5 * self.kv_usage)),
            "DCGM_FI_DEV_FB_FREE": round(self.total_mib - used),
            "DCGM_FI_DEV_FB_USED": round(used),
        }


def render(
    gpus: list[GpuState], container: str = "vllm", namespace: str = "default", pod: str = "vllm-0"
) -> str:
    lines = []
    for name, kind, help_text in FAMILIES:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for gpu in gpus:
            labels = (
                f'gpu="{gpu.index}",UUID="{gpu.uuid}",device="nvidia{gpu.index}",modelName="{gpu.model_name}",'
                f'Hostname="{gpu.hostname}",container="{container}",namespace="{namespace}",pod="{pod}"'
            )
            lines.append(f"{name}{{{labels}}} {gpu.values()[name]}")
    return "\n".join(lines) + "\n"
