"""Which GPU source to poll: NVML, the node's dcgm-exporter, or none."""

from __future__ import annotations

from typing import Any

from .base import SourceUnavailable
from .gpu import GpuSource

_NVML_OPTIONS = ("devices", "max_processes")
_DCGM_OPTIONS = ("dcgm_url", "pod_name", "pod_namespace", "gpu_uuids", "timeout_seconds", "max_body_bytes")


def _pick(options: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {name: options[name] for name in names if options.get(name) is not None}


def make_gpu_source(kind: str = "auto", **options: Any) -> GpuSource:
    """kind: auto (dcgm if a dcgm_url is given, else NVML if it initializes, else none) | nvml | dcgm | none.
    No GPU source (none, or auto finding no GPU) raises SourceUnavailable with the reason.

    Options: devices, max_processes (NVML); dcgm_url, pod_name, pod_namespace, gpu_uuids,
    timeout_seconds, max_body_bytes (DCGM). Options of the other kind are ignored.
    """
    if kind == "none":
        raise SourceUnavailable("GPU telemetry disabled (--gpu.source none)")
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
        source.release()
        raise SourceUnavailable("NVML did not initialize (no driver or no GPU visible)")
    return source
