"""The resolved settings of `serve` and `aggregate`: frozen and typed, one field per option of
config.OPTIONS and config.AGGREGATE_OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .derive.audit_kit import AuditSettings
from .derive.cost_kit import CostSettings
from .fleet_publish_kit import FleetPublishSettings
from .fleet_view_kit import FleetSourceSettings, FleetViewSettings, ReplicasSettings
from .sources.engine_kit import EngineSettings
from .sources.gpu_kit import GpuSettings
from .sources.kv_events_kit import KvEventsSettings


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """What both commands have: vLLM polling, collecting, the endpoint and logging. Aggregate takes
    each of these options from serve's table (config.shared), so they parse and check alike; the
    order here is their order in aggregate's --help and README table."""

    kv_events_topic: str
    kv_events_max_batches_per_second: int
    kv_events_discovery: str
    vllm_timeout: float
    vllm_max_body_bytes: int
    collect_interval: float
    collect_windows: list[float]
    web_listen_address: str
    web_telemetry_path: str
    web_config_file: str | None
    web_max_connections: int
    web_idle_timeout: float
    web_tls_handshake_timeout: float
    log_level: str
    log_format: str


@dataclass(frozen=True, slots=True)
class Settings(
    ServiceSettings,
    EngineSettings,
    KvEventsSettings,
    GpuSettings,
    CostSettings,
    AuditSettings,
    FleetPublishSettings,
):
    """serve's: the shared ones, each built-in source's own (declared beside it: sources/engine_kit.py,
    sources/kv_events_kit.py, sources/gpu_kit.py, derive/cost_kit.py, derive/audit_kit.py,
    fleet_publish_kit.py), then the rest."""

    collect_quantiles: list[float]
    source_options: dict[str, Any] = field(default_factory=dict)  # a SourceKit's options (kit.py)


@dataclass(frozen=True, slots=True)
class AggregateSettings(FleetSourceSettings, FleetViewSettings, ReplicasSettings, ServiceSettings):
    """aggregate's: the shared ones, then its rows' own (fleet_view_kit.py), in that order."""

    source_options: dict[str, Any] = field(default_factory=dict)  # a registered SourceKit's (kit.py)
