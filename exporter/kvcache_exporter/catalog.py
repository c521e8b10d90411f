"""Every metric the exporter serves, declared once: the entries below and, concatenated in their
place, those each source declares beside its code (DECLARED: the *_kit.py modules).

docs/metrics.md is generated from this table (`kvcache-exporter docs`); alerts and
dashboards are tested against it. Label sets are the base labels: with more than one
vLLM target every vLLM-derived series also carries `target`.
"""

from __future__ import annotations

from . import fleet_publish_kit
from .derive import audit_kit, cost_kit
from .metric import Metric
from .metric import entry as _m
from .sources import engine_kit, gpu_kit, kv_events_kit

# The modules declaring a source's entries: each section of theirs is in its place below.
DECLARED = (engine_kit, gpu_kit, audit_kit, cost_kit, kv_events_kit, fleet_publish_kit)

# Every name as a constant: call sites use these, so a typo fails at import or in a unit test.
EXPORTER_COLLECTOR_SUCCESS = "kvcache_exporter_collector_success"
EXPORTER_COLLECTOR_DURATION_SECONDS = "kvcache_exporter_collector_duration_seconds"
EXPORTER_LAST_SUCCESS_TIMESTAMP_SECONDS = "kvcache_exporter_last_success_timestamp_seconds"
EXPORTER_ERRORS_TOTAL = "kvcache_exporter_errors_total"
EXPORTER_HTTP_REJECTED_TOTAL = "kvcache_exporter_http_rejected_total"
EXPORTER_BUILD_INFO = "kvcache_exporter_build_info"
FLEET_STORED_TOKENS_TOTAL = "kvcache_fleet_stored_tokens_total"
FLEET_QUERY_TOKENS_TOTAL = "kvcache_fleet_query_tokens_total"
FLEET_HIT_TOKENS_TOTAL = "kvcache_fleet_hit_tokens_total"
FLEET_RESIDENT_BLOCKS = "kvcache_fleet_resident_blocks"
FLEET_UNTRACKED_BLOCKS_TOTAL = "kvcache_fleet_untracked_blocks_total"
FLEET_REPLICA_RESTARTS_TOTAL = "kvcache_fleet_replica_restarts_total"
FLEET_DISTINCT_BLOCKS = "kvcache_fleet_distinct_blocks"
FLEET_DUPLICATE_BLOCKS = "kvcache_fleet_duplicate_blocks"
FLEET_DUPLICATE_BLOCKS_RATIO = "kvcache_fleet_duplicate_blocks_ratio"
FLEET_HIT_RATIO = "kvcache_fleet_hit_ratio"
FLEET_HIT_RATIO_ESTIMATE = "kvcache_fleet_hit_ratio_estimate"
FLEET_HASH_SAMPLING_RATIO = "kvcache_fleet_hash_sampling_ratio"
FLEET_SESSIONS = "kvcache_fleet_sessions"
FLEET_SESSIONS_SPLIT = "kvcache_fleet_sessions_split"
FLEET_SESSIONS_SPLIT_RATIO = "kvcache_fleet_sessions_split_ratio"
FLEET_REPLICAS = "kvcache_fleet_replicas"
FLEET_REPLICAS_LEFT_OUT = "kvcache_fleet_replicas_left_out"
FLEET_DELTAS_TOTAL = "kvcache_fleet_deltas_total"
FLEET_DELTAS_DROPPED_TOTAL = "kvcache_fleet_deltas_dropped_total"
FLEET_CONSUMER_PENDING = "kvcache_fleet_consumer_pending"
FLEET_CONSUMER_REDELIVERED_TOTAL = "kvcache_fleet_consumer_redelivered_total"


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
    _m(
        FLEET_STORED_TOKENS_TOTAL,
        "counter",
        "Tokens in blocks the replica computed and stored (BlockStored), the denominator of the "
        "other_replica share.",
        ("replica",),
        "tokens",
        "fleet",
        "BlockStored events",
        "stored blocks x block_size / hash sampling",
    ),
    _m(
        FLEET_QUERY_TOKENS_TOTAL,
        "counter",
        "Prompt tokens looked up in the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_queries_total",
        "sum over engines",
    ),
    _m(
        FLEET_HIT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens served from the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_hits_total",
        "sum over engines",
    ),
    _m(
        FLEET_RESIDENT_BLOCKS,
        "gauge",
        "Blocks the replica holds according to its KV-event stream (tracked ones, scaled).",
        ("replica",),
        "blocks",
        "fleet",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    _m(
        FLEET_UNTRACKED_BLOCKS_TOTAL,
        "counter",
        "Stored blocks not tracked because the replica's bound (--replica.max-blocks) was full.",
        ("replica",),
        "blocks",
        "fleet",
        "aggregator bound",
    ),
    _m(
        FLEET_REPLICA_RESTARTS_TOTAL,
        "counter",
        "Times the replica's KV-event publisher started again (sequence back to 0): its blocks were "
        "dropped from the pool view.",
        ("replica",),
        "",
        "fleet",
        "KV-event sequence numbers",
    ),
    _m(
        FLEET_DISTINCT_BLOCKS,
        "gauge",
        "Distinct block hashes resident anywhere in the pool (scaled by 1/sampling).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    _m(
        FLEET_DUPLICATE_BLOCKS,
        "gauge",
        "Block hashes resident on two or more replicas at once: KV memory spent twice (scaled).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    _m(
        FLEET_DUPLICATE_BLOCKS_RATIO,
        "gauge",
        "Share of the pool's distinct resident blocks held by two or more replicas.",
        (),
        "ratio",
        "fleet",
        "every replica's KV events",
        "duplicate_blocks / distinct_blocks",
    ),
    _m(
        FLEET_HIT_RATIO,
        "gauge",
        "The pool's real prefix-cache hit ratio over the window.",
        ("window",),
        "ratio",
        "fleet",
        "vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total of every replica",
        "sum(hits) / sum(queries)",
    ),
    _m(
        FLEET_HIT_RATIO_ESTIMATE,
        "gauge",
        "The pool's hit ratio had every request gone to a replica holding its prefix (routing="
        "prefix_affinity), beside kvcache_fleet_hit_ratio.",
        ("window", "routing"),
        "ratio",
        "fleet",
        "/metrics and KV events of every replica",
        "min((sum(hits) + sum(other_replica miss tokens)) / sum(queries), 1); a shard scales its "
        "other_replica by its number of shards",
    ),
    _m(
        FLEET_SESSIONS,
        "gauge",
        "Sessions (BlockStored session_id) seen storing blocks in the pool lately: within one to two "
        "of the longest window, at most 65,536. Absent while no event carries a session id.",
        (),
        "",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
    ),
    _m(
        FLEET_SESSIONS_SPLIT,
        "gauge",
        "Of kvcache_fleet_sessions, those whose blocks were stored on two or more replicas: "
        "sessions the router split, from ground truth.",
        (),
        "",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
    ),
    _m(
        FLEET_SESSIONS_SPLIT_RATIO,
        "gauge",
        "Share of the pool's sessions whose blocks landed on two or more replicas (0 with sticky "
        "session routing), beside the prefix_affinity estimate.",
        (),
        "ratio",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
        "sessions_split / sessions",
    ),
    _m(
        FLEET_HASH_SAMPLING_RATIO,
        "gauge",
        "Fraction of the block-hash space the aggregator tracks (--fleet.hash-sampling); counts are "
        "scaled by its inverse.",
        (),
        "ratio",
        "fleet",
        "configuration",
    ),
    _m(
        FLEET_REPLICAS,
        "gauge",
        "Replicas the aggregator watches (from discovery, bounded by --replica.max).",
        (),
        "",
        "fleet",
        "discovery",
    ),
    _m(
        FLEET_REPLICAS_LEFT_OUT,
        "gauge",
        "Replicas discovery found beyond --replica.max, not watched.",
        (),
        "",
        "fleet",
        "discovery",
    ),
    # --- the fleet view on NATS JetStream (serve --fleet.publish, aggregate --fleet.source) -----
    *fleet_publish_kit.METRICS,
    _m(
        FLEET_DELTAS_TOTAL,
        "counter",
        "Residency deltas and counters an aggregator shard read from NATS JetStream and applied.",
        (),
        "messages",
        "fleet",
        "aggregate --fleet.source",
    ),
    _m(
        FLEET_DELTAS_DROPPED_TOTAL,
        "counter",
        "Messages an aggregator shard read from NATS and dropped: parse_error, too_large, forged (pool, "
        "range or replica differs from the subject's), sampling_mismatch (published with another "
        "--fleet.hash-sampling), stale (an earlier epoch of the replica), duplicate (a redelivery or "
        "replay of a delta already applied), too_many_replicas (beyond --replica.max), unknown_engine "
        "(an engine other than vllm, sglang, trtllm), engine_changed (another engine within an epoch).",
        ("reason",),
        "messages",
        "fleet",
        "aggregate --fleet.source",
    ),
    _m(
        FLEET_CONSUMER_PENDING,
        "gauge",
        "Messages JetStream holds for the shard's durable consumer and has not delivered yet: consumer lag.",
        ("consumer",),
        "messages",
        "fleet",
        "JetStream consumer info (num_pending)",
    ),
    _m(
        FLEET_CONSUMER_REDELIVERED_TOTAL,
        "counter",
        "Messages JetStream delivered to the shard more than once (not acked in time, or a restart).",
        (),
        "messages",
        "fleet",
        "JetStream message metadata (num_delivered > 1)",
    ),
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
