"""`serve`: its sources as rows (ROWS, then every registered row: kit.py), built by kit.engine into
the one poll engine (collector.Exporter), as `aggregate`'s are (aggregator/rows.py); service.py runs
it behind the HTTP server."""

from __future__ import annotations

import time
from collections.abc import Callable

from . import fleet_publish_kit, kit, kv_event_rows, source_rows
from .collector import Exporter
from .derive import audit_kit, cost_kit, registry
from .derive.cost import Pricing
from .derive.registry import DeriveOptions
from .derive.state import PollState
from .kit import SourceKit
from .settings import Settings
from .sources import engine_kit, gpu_kit, kv_events_kit

# In poll order and derivation order. A row with only derivations reads what the others polled.
ROWS: tuple[SourceKit, ...] = (
    SourceKit(
        "vllm",
        engine_kit.METRICS,
        engine_kit.OPTIONS,
        source_rows.wire_engines,
        derivations={"targets": registry.targets},
        timeout=source_rows.engine_timeout,
    ),
    SourceKit(
        "kv_events",
        kv_events_kit.METRICS,
        kv_events_kit.OPTIONS,
        kv_event_rows.wire_streams,
        derivations={"kv_events": registry.kv_events, "attribution": registry.attribution},
        built=kv_event_rows.debug_pages,
    ),
    SourceKit(
        "gpu", gpu_kit.METRICS, gpu_kit.OPTIONS, source_rows.wire_gpu, {"gpu": registry.gpu}, gpu_kit.timeout
    ),
    SourceKit("kv_event_discovery", wire=kv_event_rows.wire_discovery, built=kv_event_rows.discovery_built),
    SourceKit(
        "fleet_publish", fleet_publish_kit.METRICS, fleet_publish_kit.OPTIONS, kv_event_rows.wire_publisher
    ),
    SourceKit("cost", cost_kit.METRICS, cost_kit.OPTIONS, derivations={"cost": registry.cost}),
    SourceKit("audit", audit_kit.METRICS, audit_kit.OPTIONS, derivations={"audit": registry.audit}),
)


def build_exporter(s: Settings, clock: Callable[[], float] = time.time) -> Exporter:
    """Every row's polls into one PollState, their derivations into one table, one engine."""
    state = PollState(
        retention=max(s.collect_windows) + 2 * s.collect_interval, host_tier_bytes=s.whatif_host_tier_bytes
    )
    options = DeriveOptions(
        windows=tuple(sorted(s.collect_windows)),
        quantiles=tuple(s.collect_quantiles),
        pricing=pricing_from(s),
        gpu_count=s.cost_gpu_count,
        gpu_memory_utilization_ceiling=s.audit_gpu_memory_utilization_ceiling,
    )
    return kit.engine(
        ROWS, s, state, options, interval=s.collect_interval, clock=clock, registered=kit.registered("serve")
    )


def pricing_from(settings: Settings) -> Pricing:
    table: dict[str, float] = dict(settings.cost_gpu_hour_prices)
    if table and settings.cost_gpu_hour_price is not None:
        table.setdefault("default", settings.cost_gpu_hour_price)
    return Pricing(
        gpu_hour_price=table or settings.cost_gpu_hour_price,
        currency=settings.cost_currency,
        energy_price_per_kwh=settings.cost_energy_price_per_kwh,
        hit_ratio_floor=settings.cost_hit_ratio_floor,
    )
