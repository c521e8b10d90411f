"""Every metric the exporter serves, declared once: its own health entries below and, concatenated in
their place, those each source declares beside its code (DECLARED: the *_kit.py modules; `aggregate`'s
in fleet_view_kit.py).

docs/metrics.md is generated from this table (`kvcache-exporter docs`); alerts and
dashboards are tested against it. Label sets are the base labels: with more than one
vLLM target every vLLM-derived series also carries `target`.
"""

from __future__ import annotations

from . import fleet_publish_kit, fleet_view_kit
from .derive import audit_kit, cost_kit
from .metric import Metric
from .metric import entry as _m
from .sources import engine_kit, gpu_kit, kv_events_kit

# The modules declaring a source's entries: each section of theirs is in its place below.
DECLARED = (engine_kit, gpu_kit, audit_kit, cost_kit, kv_events_kit, fleet_view_kit, fleet_publish_kit)

# Every name as a constant: call sites use these, so a typo fails at import or in a unit test.
EXPORTER_COLLECTOR_SUCCESS = "kvcache_exporter_collector_success"
EXPORTER_COLLECTOR_DURATION_SECONDS = "kvcache_exporter_collector_duration_seconds"
EXPORTER_LAST_SUCCESS_TIMESTAMP_SECONDS = "kvcache_exporter_last_success_timestamp_seconds"
EXPORTER_ERRORS_TOTAL = "kvcache_exporter_errors_total"
EXPORTER_HTTP_REJECTED_TOTAL = "kvcache_exporter_http_rejected_total"
EXPORTER_BUILD_INFO = "kvcache_exporter_build_info"


CATALOG: tuple[Metric, ...] = (
    # --- prefix cache ---------------------------------------------------------------
    *engine_kit.CACHE,
    # --- GPU --------------------------------------------------------------------------
    *gpu_kit.METRICS,
    # --- config audit -----------------------------------------------------------------
    *audit_kit.METRICS,
    # --- cost and energy --------------------------------------------------------------
    *cost_kit.METRICS,
    # --- KV events ----------------------------------------------------------------------
    *kv_events_kit.EVENTS,
    # --- fleet view (`kvcache-exporter aggregate`) -----------------------------------------
    *fleet_view_kit.FLEET,
    # --- the fleet view on NATS JetStream (serve --fleet.publish, aggregate --fleet.source) -----
    *fleet_publish_kit.METRICS,
    # --- aggregate --fleet.source: the shards' side
    *fleet_view_kit.SHARDS,
    # --- KV offloading (vLLM 0.33 /metrics, derive/offload.py) --------------------------------------
    *engine_kit.OFFLOAD,
    # --- KV-event groups and hit units (derive/units.py) ------------------------------------------
    *kv_events_kit.UNITS,
    # --- miss attribution (KV events) ---------------------------------------------------------
    *kv_events_kit.ATTRIBUTION,
    # --- vLLM schema, then the exporter's own health ------------------------------------------------
    *engine_kit.HEALTH,
    _m(
        EXPORTER_COLLECTOR_SUCCESS,
        "gauge",
        "1 when the collector's last run succeeded.",
        ("collector",),
        "",
        "health",
    ),
    _m(
        EXPORTER_COLLECTOR_DURATION_SECONDS,
        "gauge",
        "How long the collector's last run took.",
        ("collector",),
        "seconds",
        "health",
    ),
    _m(
        EXPORTER_LAST_SUCCESS_TIMESTAMP_SECONDS,
        "gauge",
        "Unix time of the collector's last successful run.",
        ("collector",),
        "seconds",
        "health",
    ),
    _m(
        EXPORTER_ERRORS_TOTAL,
        "counter",
        "Collector errors by reason (timeout, connection, http_status, parse_error, body_too_large, "
        "too_many_series, fd_exhausted: the exporter's own open-file limit, not the target, ...).",
        ("collector", "reason"),
        "",
        "health",
    ),
    _m(
        EXPORTER_HTTP_REJECTED_TOTAL,
        "counter",
        "Connections and requests our endpoint refused, by reason: too_many_connections (every slot "
        "has a request in flight), idle_evicted (an idle connection closed to let a new one in), "
        "tls_handshake (failed or timed out), header_too_large, bad_request, auth_busy (too many "
        "checks of unknown passwords queued).",
        ("reason",),
        "",
        "health",
        per_target=False,
    ),
    _m(
        EXPORTER_BUILD_INFO,
        "gauge",
        "Exporter version (value 1).",
        ("version", "python_version"),
        "",
        "health",
        per_target=False,
    ),
)

BY_NAME: dict[str, Metric] = {m.name: m for m in CATALOG}
# A declaring module's name constants are the catalog's too: catalog.GPU_POWER_WATTS is
# gpu_kit.GPU_POWER_WATTS, so call sites read every name from one place.
globals().update(
    (k, v) for m in DECLARED for k, v in vars(m).items() if k.isupper() and str(v).startswith("kvcache_")
)


def constant_name(metric_name: str) -> str:
    """kvcache_prefix_cache_hit_ratio -> PREFIX_CACHE_HIT_RATIO, the constant call sites use."""
    return metric_name.removeprefix("kvcache_").upper()


def _check_constants() -> None:
    """Every family has its constant and every constant its family: a new one needs both."""
    constants = {
        v for k, v in globals().items() if k.isupper() and isinstance(v, str) and v.startswith("kvcache_")
    }
    assert constants == set(BY_NAME), sorted(constants ^ set(BY_NAME))
    assert all(globals().get(constant_name(name)) == name for name in BY_NAME)
    assert len(BY_NAME) == len(CATALOG), "a family is declared twice"


_check_constants()


def get(name: str) -> Metric:
    return BY_NAME[name]


def add(metrics: tuple[Metric, ...]) -> None:
    """A source's own entries (kit.register): the catalog is the built-ins, then each row's."""
    global CATALOG
    taken = [m.name for m in metrics if m.name in BY_NAME]
    if taken or len({m.name for m in metrics}) != len(metrics):
        raise ValueError(f"metric declared twice: {', '.join(taken) or 'within one source'}")
    CATALOG = CATALOG + tuple(metrics)
    BY_NAME.update((m.name, m) for m in metrics)
