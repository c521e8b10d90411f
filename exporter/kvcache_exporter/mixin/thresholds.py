"""What the dashboards take from the mixin's config; no Grafana SDK needed to compute it, so the
CLI can tell whether the pre-rendered dashboards already fit a user's config."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DashboardThresholds:
    """What the dashboards take from the mixin's config (the alerts' own thresholds and URLs)."""

    runbook_url: str
    hit_ratio_floor: float
    ttft_seconds: float
    prefill_seconds: float
    block_utilization: float
    memory_budget: float

    @classmethod
    def of(cls, cfg: dict) -> DashboardThresholds:
        alerts, latencies = cfg["alerts"], cfg["slo"]["latencies"]
        return cls(
            runbook_url=cfg["urls"]["runbook"],
            hit_ratio_floor=float(alerts["KVCacheHitRatioBelowFloor"]["threshold"]),
            ttft_seconds=float(latencies["TimeToFirstToken"]["threshold_seconds"]),
            prefill_seconds=float(latencies["PrefillLatency"]["threshold_seconds"]),
            block_utilization=float(alerts["KVCacheSaturated"]["threshold"]),
            memory_budget=float(alerts["KVCacheGPUMemoryOverBudget"]["threshold"]),
        )
