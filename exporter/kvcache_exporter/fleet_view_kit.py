"""What `kvcache-exporter aggregate` (aggregator/) declares beside its code, for its rows
(aggregator/rows.py): the replicas' options (REPLICAS_OPTIONS), the fleet view's catalog entries
(FLEET) and options, the NATS intake's (`--fleet.source`) entries (SHARDS) and options, each with
its typed settings (settings.AggregateSettings has them all) and checks. catalog.py puts each
section in its place; config.AGGREGATE_OPTIONS concatenates the options, then serve's shared ones.
Here, not in aggregator/, because `serve` loads the catalog and the option tables and never the
tools (tests/core/test_layering.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from . import fleet_publish_kit
from .metric import entry
from .options import (
    AGGREGATE_ENV_PREFIX,
    Option,
    at_least,
    between,
    duration,
    nats_url,
    port,
    sampling,
    shard,
    size,
)


def _aggregate(key: str, parse: Any, default: Any, help: str, **more: Any) -> Option:
    return Option(key, parse, default, help, env_prefix=AGGREGATE_ENV_PREFIX, **more)


def _twin(*keys: str) -> tuple[Option, ...]:
    """serve's fleet options (fleet_publish_kit), as they are for `aggregate`."""
    by_key = {o.key: o for o in fleet_publish_kit.OPTIONS}
    return tuple(replace(by_key[key], env_prefix=AGGREGATE_ENV_PREFIX) for key in keys)


# --- the replicas: where they are (discovery) and their /metrics polls --------------------------
REPLICAS_OPTIONS = (
    _aggregate(
        "replica.targets",
        str,
        [],
        "TARGET[,KV_ENDPOINT[,ENGINE]] of a replica (host:port or URL; ENGINE vllm, sglang or trtllm);"
        " repeat, whitespace-separated in the env",
        multiple=True,
        flag_name="--replica",
        separator=None,
    ),
    _aggregate("discovery.file_sd", str, None, "Prometheus file_sd JSON/YAML file, re-read on change"),
    _aggregate("discovery.dns", str, None, "NAME:PORT of a headless Service (A/AAAA records)"),
    _aggregate(
        "discovery.refresh_interval",
        duration,
        30.0,
        "how often --discovery.dns is resolved, and each replica's /kv_event_sources asked, again",
    ),
    _aggregate(
        "replica.kv_events_port",
        port,
        5557,
        "KV-event port of a replica that names none, where its vLLM does not say (0: none)",
    ),
    _aggregate("replica.max", at_least(1), 64, "replicas watched at most; the rest are counted left out"),
)


@dataclass(frozen=True)
class ReplicasSettings:
    replica_targets: list[str]
    discovery_file_sd: str | None
    discovery_dns: str | None
    discovery_refresh_interval: float
    replica_kv_events_port: int
    replica_max: int


def checks(s: Any) -> list[tuple[str, str]]:
    """An aggregator with nothing to read is refused at start-up (and by --check-config)."""
    if s.replica_targets or s.discovery_file_sd or s.discovery_dns or s.fleet_source:
        return []
    return [
        ("--replica", "name the replicas (--replica, --discovery.file-sd, --discovery.dns) or --fleet.source")
    ]


# The fleet view's and the shards' names (catalog.py has each as its own constant too)
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
FLEET_SESSIONS = "kvcache_fleet_sessions"
FLEET_SESSIONS_SPLIT = "kvcache_fleet_sessions_split"
FLEET_SESSIONS_SPLIT_RATIO = "kvcache_fleet_sessions_split_ratio"
FLEET_HASH_SAMPLING_RATIO = "kvcache_fleet_hash_sampling_ratio"
FLEET_REPLICAS = "kvcache_fleet_replicas"
FLEET_REPLICAS_LEFT_OUT = "kvcache_fleet_replicas_left_out"
FLEET_DELTAS_TOTAL = "kvcache_fleet_deltas_total"
FLEET_DELTAS_DROPPED_TOTAL = "kvcache_fleet_deltas_dropped_total"
FLEET_CONSUMER_PENDING = "kvcache_fleet_consumer_pending"
FLEET_CONSUMER_REDELIVERED_TOTAL = "kvcache_fleet_consumer_redelivered_total"


# --- the fleet view ------------------------------------------------------------------------------
VIEW_OPTIONS = (
    _aggregate("replica.max_blocks", at_least(1), 131_072, "block hashes remembered per replica"),
    _aggregate("fleet.hash_sampling", sampling, 1.0, "fraction of block hashes kept (0 < f <= 1)"),
    _aggregate("fleet.shard", shard, "0/1", "K/N: keep the K-th of N hash ranges"),
)


@dataclass(frozen=True)
class FleetViewSettings:
    replica_max_blocks: int
    fleet_hash_sampling: float
    fleet_shard: str


FLEET = (
    entry(
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
    entry(
        FLEET_QUERY_TOKENS_TOTAL,
        "counter",
        "Prompt tokens looked up in the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_queries_total",
        "sum over engines",
    ),
    entry(
        FLEET_HIT_TOKENS_TOTAL,
        "counter",
        "Prompt tokens served from the replica's prefix cache (all engines), as polled by the aggregator.",
        ("replica",),
        "tokens",
        "fleet",
        "vllm:prefix_cache_hits_total",
        "sum over engines",
    ),
    entry(
        FLEET_RESIDENT_BLOCKS,
        "gauge",
        "Blocks the replica holds according to its KV-event stream (tracked ones, scaled).",
        ("replica",),
        "blocks",
        "fleet",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    entry(
        FLEET_UNTRACKED_BLOCKS_TOTAL,
        "counter",
        "Stored blocks not tracked because the replica's bound (--replica.max-blocks) was full.",
        ("replica",),
        "blocks",
        "fleet",
        "aggregator bound",
    ),
    entry(
        FLEET_REPLICA_RESTARTS_TOTAL,
        "counter",
        "Times the replica's KV-event publisher started again (sequence back to 0): its blocks were "
        "dropped from the pool view.",
        ("replica",),
        "",
        "fleet",
        "KV-event sequence numbers",
    ),
    entry(
        FLEET_DISTINCT_BLOCKS,
        "gauge",
        "Distinct block hashes resident anywhere in the pool (scaled by 1/sampling).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    entry(
        FLEET_DUPLICATE_BLOCKS,
        "gauge",
        "Block hashes resident on two or more replicas at once: KV memory spent twice (scaled).",
        (),
        "blocks",
        "fleet",
        "every replica's KV events",
    ),
    entry(
        FLEET_DUPLICATE_BLOCKS_RATIO,
        "gauge",
        "Share of the pool's distinct resident blocks held by two or more replicas.",
        (),
        "ratio",
        "fleet",
        "every replica's KV events",
        "duplicate_blocks / distinct_blocks",
    ),
    entry(
        FLEET_HIT_RATIO,
        "gauge",
        "The pool's real prefix-cache hit ratio over the window.",
        ("window",),
        "ratio",
        "fleet",
        "vllm:prefix_cache_hits_total, vllm:prefix_cache_queries_total of every replica",
        "sum(hits) / sum(queries)",
    ),
    entry(
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
    entry(
        FLEET_SESSIONS,
        "gauge",
        "Sessions (BlockStored session_id) seen storing blocks in the pool lately: within one to two "
        "of the longest window, at most 65,536. Absent while no event carries a session id.",
        (),
        "",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
    ),
    entry(
        FLEET_SESSIONS_SPLIT,
        "gauge",
        "Of kvcache_fleet_sessions, those whose blocks were stored on two or more replicas: "
        "sessions the router split, from ground truth.",
        (),
        "",
        "fleet",
        "session_id on every replica's BlockStored events (vLLM 0.32+)",
    ),
    entry(
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
    entry(
        FLEET_HASH_SAMPLING_RATIO,
        "gauge",
        "Fraction of the block-hash space the aggregator tracks (--fleet.hash-sampling); counts are "
        "scaled by its inverse.",
        (),
        "ratio",
        "fleet",
        "configuration",
    ),
    entry(
        FLEET_REPLICAS,
        "gauge",
        "Replicas the aggregator watches (from discovery, bounded by --replica.max).",
        (),
        "",
        "fleet",
        "discovery",
    ),
    entry(
        FLEET_REPLICAS_LEFT_OUT,
        "gauge",
        "Replicas discovery found beyond --replica.max, not watched.",
        (),
        "",
        "fleet",
        "discovery",
    ),
)


# --- the NATS intake (--fleet.source): a shard's part of the pool from JetStream -----------------
SOURCE_OPTIONS = (
    _aggregate("fleet.source", nats_url, None, "NATS JetStream URL to read the pool's residency from"),
    *_twin("fleet.pool", "fleet.subject_prefix"),
    _aggregate("fleet.retention", duration, 6 * 3600.0, "how long the pool's stream keeps deltas"),
    _aggregate("fleet.max_bytes", size, 8 * 1024**3, "the pool's stream size at most"),
    _aggregate(
        "fleet.stream_replicas",
        between(1, 5),
        1,
        "JetStream replicas of the pool's stream when this shard creates it (3 on a 3-node cluster)",
    ),
    *_twin("fleet.credentials_file", "fleet.nkey_seed_file", "fleet.tls_ca_file"),
)


@dataclass(frozen=True)
class FleetSourceSettings:
    fleet_source: str | None
    fleet_pool: str
    fleet_subject_prefix: str
    fleet_retention: float
    fleet_max_bytes: int
    fleet_stream_replicas: int
    fleet_credentials_file: str | None
    fleet_nkey_seed_file: str | None
    fleet_tls_ca_file: str | None


SHARDS = (
    entry(
        FLEET_DELTAS_TOTAL,
        "counter",
        "Residency deltas and counters an aggregator shard read from NATS JetStream and applied.",
        (),
        "messages",
        "fleet",
        "aggregate --fleet.source",
    ),
    entry(
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
    entry(
        FLEET_CONSUMER_PENDING,
        "gauge",
        "Messages JetStream holds for the shard's durable consumer and has not delivered yet: consumer lag.",
        ("consumer",),
        "messages",
        "fleet",
        "JetStream consumer info (num_pending)",
    ),
    entry(
        FLEET_CONSUMER_REDELIVERED_TOTAL,
        "counter",
        "Messages JetStream delivered to the shard more than once (not acked in time, or a restart).",
        (),
        "messages",
        "fleet",
        "JetStream message metadata (num_delivered > 1)",
    ),
)


OPTIONS = REPLICAS_OPTIONS + VIEW_OPTIONS + SOURCE_OPTIONS  # in aggregate's --help, before the shared
SECTIONS = (FLEET, SHARDS)  # each in its own place in catalog.py
METRICS = FLEET + SHARDS
