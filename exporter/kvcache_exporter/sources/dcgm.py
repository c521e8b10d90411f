"""GPU telemetry scraped from the node's dcgm-exporter, keeping only this pod's GPUs.

A sidecar in a Kubernetes pod often cannot open NVML for its pod's GPUs; the node's dcgm-exporter
can, and labels each GPU's series with the pod it is allocated to (pod, namespace, container).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from prometheus_client.parser import text_string_to_metric_families

from .base import SourceError
from .gpu import GpuDevice, GpuSnapshot
from .http import fetch_text, new_session

MIB = 1024 * 1024

# DCGM field -> (GpuDevice attribute, divisor to the catalog's unit)
_FIELDS = {
    "DCGM_FI_DEV_GPU_UTIL": ("utilization_ratio", 100),  # %
    "DCGM_FI_DEV_MEM_COPY_UTIL": ("memory_utilization_ratio", 100),  # %
    "DCGM_FI_DEV_POWER_USAGE": ("power_watts", 1),
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": ("energy_joules", 1000),  # mJ
    "DCGM_FI_DEV_GPU_TEMP": ("temperature_celsius", 1),
}
_MEMORY = ("DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_RESERVED", "DCGM_FI_DEV_FB_TOTAL")


def _selected(
    labels: Mapping[str, str], pod_name: str | None, pod_namespace: str | None, gpu_uuids: Collection[str]
) -> bool:
    if gpu_uuids:
        return labels.get("UUID") in gpu_uuids
    return labels.get("pod") == pod_name and (not pod_namespace or labels.get("namespace") == pod_namespace)


def _memory(fields: Mapping[str, float]) -> tuple[float | None, float | None]:
    used, free = fields.get("DCGM_FI_DEV_FB_USED"), fields.get("DCGM_FI_DEV_FB_FREE")
    total = fields.get("DCGM_FI_DEV_FB_TOTAL")
    if total is None and used is not None and free is not None:
        total = used + free + fields.get("DCGM_FI_DEV_FB_RESERVED", 0.0)
    return (None if used is None else used * MIB), (None if total is None else total * MIB)


def _device(labels: Mapping[str, str], fields: Mapping[str, float]) -> GpuDevice:
    used, total = _memory(fields)
    measured = {attr: fields[name] / divisor for name, (attr, divisor) in _FIELDS.items() if name in fields}
    return GpuDevice(
        index=int(labels.get("gpu", -1)),
        uuid=labels.get("UUID", ""),
        name=labels.get("modelName", ""),
        memory_used_bytes=used,
        memory_total_bytes=total,
        **measured,
    )


def parse_dcgm(
    text: str,
    pod_name: str | None = None,
    pod_namespace: str | None = None,
    gpu_uuids: Collection[str] = (),
) -> GpuSnapshot:
    """The GPUs of one pod (or of the given UUIDs) in a dcgm-exporter scrape.

    A GPU shared by several pods (time-slicing, MPS) repeats its device-wide values once per pod;
    the first series of each field wins. MIG instances of one GPU are not told apart.
    """
    identity: dict[str, Mapping[str, str]] = {}
    fields: dict[str, dict[str, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name not in _FIELDS and family.name not in _MEMORY:
                continue
            for sample in family.samples:
                # the parser names a counter's sample <name>_total when dcgm-exporter TYPEs it counter
                if not _selected(sample.labels, pod_name, pod_namespace, gpu_uuids):
                    continue
                uuid = sample.labels.get("UUID", "")
                identity.setdefault(uuid, sample.labels)
                fields.setdefault(uuid, {}).setdefault(family.name, sample.value)
    except ValueError as error:
        raise SourceError("parse_error", f"dcgm-exporter output does not parse: {error}") from error
    devices = sorted((_device(identity[uuid], fields[uuid]) for uuid in identity), key=lambda d: d.index)
    return GpuSnapshot(tuple(devices))


class DcgmSource:
    name = "gpu"

    def __init__(
        self,
        url: str,
        pod_name: str | None = None,
        pod_namespace: str | None = None,
        gpu_uuids: Collection[str] = (),
        timeout_seconds: float = 5.0,
        max_body_bytes: int = 16 * MIB,
    ):
        if not pod_name and not gpu_uuids:
            raise ValueError("the dcgm GPU source needs this pod's name (POD_NAME) or GPU UUIDs")
        self.url = url
        self.pod_name, self.pod_namespace, self.gpu_uuids = pod_name, pod_namespace, frozenset(gpu_uuids)
        self.timeout = timeout_seconds
        self.max_body_bytes = max_body_bytes

    async def _fetch(self) -> str:
        async with new_session() as session:
            return await fetch_text(session, self.url, timeout=self.timeout, max_bytes=self.max_body_bytes)

    async def collect(self) -> GpuSnapshot:
        snapshot = parse_dcgm(await self._fetch(), self.pod_name, self.pod_namespace, self.gpu_uuids)
        if not snapshot.devices:
            who = f"pod {self.pod_namespace or '*'}/{self.pod_name}" if not self.gpu_uuids else "GPU UUIDs"
            raise SourceError("no_matching_gpu", f"{self.url} has no GPU series for {who}")
        return snapshot

    async def close(self) -> None:
        pass  # one HTTP session per collection: nothing held between them
