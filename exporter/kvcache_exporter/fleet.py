"""Derivations across sources: GPU telemetry and memory, config audit, cost and energy.

These need more than one vLLM engine's history (tokens summed over every engine, the GPU
snapshot, every target's cache config), so they run once per poll over the whole exporter.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .collector import Exporter
from .config import window_label
from .derive import audit, cost, memory
from .derive.cache_config import config_number
from .derive.windows import advance
from .sources.base import Sample
from .sources.gpu import GpuSnapshot, gpu_samples


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

    def ingest(self, snapshot: GpuSnapshot) -> None:
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
            points.append(GpuPoint(snapshot.ts, device.memory_used_bytes, total, device.power_watts))
            while points and points[0].ts < snapshot.ts - self.retention:
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


def window_usage(exporter: Exporter, seconds: float, gpu: GpuHistory, now: float) -> cost.WindowUsage | None:
    """Token and time increases over the window, summed over every target and engine."""
    sums = {"prompt_tokens": 0.0, "generation_tokens": 0.0, "cached_prompt_tokens": 0.0}
    prefill = decode = 0.0
    span = 0.0
    for target in exporter.targets:
        for history in target.histories.values():
            delta = history.window(seconds)
            if delta is None:
                continue
            span = max(span, delta.seconds)
            for key in sums:
                sums[key] += delta.counters.get(key, 0.0)
            prefill += delta.histograms.get("prefill", ((), (), 0.0))[2]
            decode += delta.histograms.get("decode", ((), (), 0.0))[2]
    if span <= 0:
        return None
    return cost.WindowUsage(
        window_seconds=span,
        prompt_tokens=sums["prompt_tokens"],
        generation_tokens=sums["generation_tokens"],
        cached_tokens=sums["cached_prompt_tokens"],
        prefill_seconds=prefill,
        decode_seconds=decode,
        energy_joules=gpu.energy_increase(span, now),
        mean_power_watts=gpu.mean_power(span, now),
    )


class Fleet:
    """The exporter-wide derivations; registered as an `extra` of the Exporter."""

    def __init__(self, pricing: cost.Pricing, ceiling: float, retention: float, gpu_count: int = 1):
        self.pricing = pricing
        self.gpu_count = gpu_count
        self.ceiling = ceiling
        self.gpu = GpuHistory(retention)
        self._peaks: deque[tuple[float, dict[str, float]]] = deque()
        self.retention = retention

    def __call__(self, exporter: Exporter) -> list[Sample]:
        now = exporter.clock()
        snapshot: GpuSnapshot | None = exporter.results.get("gpu")
        out: list[Sample] = []
        if snapshot is not None:
            self.gpu.ingest(snapshot)
            out += gpu_samples(snapshot) + self._memory(exporter, snapshot)
        # Without GPU telemetry the configured GPU count is priced at the single (or "default") price.
        names = [d.name for d in snapshot.devices] if snapshot else ["unknown"] * self.gpu_count
        hourly = cost.gpu_cost_per_hour(names, self.pricing.gpu_hour_price)
        out += cost.cost_info_samples(self.pricing, names)
        for seconds in exporter.windows:
            usage = window_usage(exporter, seconds, self.gpu, now)
            if usage is not None:
                out += cost.cost_window_samples(window_label(seconds), usage, hourly, self.pricing)
        return out + self._audit(exporter, now)

    def _memory(self, exporter: Exporter, snapshot: GpuSnapshot) -> list[Sample]:
        utilization = next(
            (
                value
                for target in exporter.targets
                if target.snapshot
                for config in target.snapshot.cache_configs.values()
                if (value := config_number(config, "gpu_memory_utilization")) is not None
            ),
            None,
        )
        out, used = [], self.gpu.used()
        for i, seconds in enumerate(exporter.windows):
            samples = memory.memory_samples(snapshot, utilization, used, window_label(seconds), seconds)
            out += samples if i == 0 else [s for s in samples if s.name == "kvcache_gpu_memory_swing_bytes"]
        return out

    def _audit(self, exporter: Exporter, now: float) -> list[Sample]:
        configs: dict[str, list[dict[str, str]]] = {}
        deprecated: dict[str, set[str]] = {}
        load: dict[str, float] = {}
        for target in exporter.targets:
            snap = target.snapshot
            if snap is None or not target.up:
                continue
            for engine, config in snap.cache_configs.items():
                model = snap.model_of(engine)
                configs.setdefault(model, []).append(config)
                deprecated.setdefault(model, set()).update(snap.deprecated)
            for (model, _), sample in snap.engines.items():
                load[model] = (
                    load.get(model, 0.0) + sample.gauges.get("running", 0) + sample.gauges.get("waiting", 0)
                )
        self._peaks.append((now, load))
        while self._peaks and self._peaks[0][0] < now - self.retention:
            self._peaks.popleft()
        out = []
        for model, model_configs in configs.items():
            peak = max((loads.get(model, 0.0) for _, loads in self._peaks), default=None)
            out += audit.config_checks(
                model,
                model_configs,
                peak_requests=peak,
                typical_request_tokens=_typical_request_tokens(exporter, model),
                deprecated_metrics=deprecated.get(model, set()),
                gpu_memory_utilization_ceiling=self.ceiling,
            )
        return out


def _typical_request_tokens(exporter: Exporter, model: str) -> float | None:
    """Mean prompt + generated tokens per finished request over the longest window."""
    tokens = requests = 0.0
    for target in exporter.targets:
        for (name, _), history in target.histories.items():
            delta = history.window(max(exporter.windows)) if name == model else None
            if delta is None or "e2e" not in delta.histograms:
                continue
            requests += delta.histograms["e2e"][1][-1]
            tokens += delta.counters.get("prompt_tokens", 0.0) + delta.counters.get("generation_tokens", 0.0)
    return tokens / requests if requests > 0 else None


def pricing_from(settings) -> cost.Pricing:
    table: dict[str, float] = dict(settings.cost_gpu_hour_prices)
    if table and settings.cost_gpu_hour_price is not None:
        table.setdefault("default", settings.cost_gpu_hour_price)
    return cost.Pricing(
        gpu_hour_price=table or settings.cost_gpu_hour_price,
        currency=settings.cost_currency,
        energy_price_per_kwh=settings.cost_energy_price_per_kwh,
        hit_ratio_floor=settings.cost_hit_ratio_floor,
    )
