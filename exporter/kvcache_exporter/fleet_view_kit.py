"""What `kvcache-exporter aggregate` (aggregator/) declares for the catalog: the fleet view's entries
(FLEET) and its shards' side of NATS JetStream (SHARDS), each in its place in catalog.py. Here, not
in aggregator/, because `serve` loads the catalog and never the tools (tests/core/test_layering.py).
Its options stay in config.AGGREGATE_OPTIONS (built from serve's table's shared rows)."""

from __future__ import annotations

from .metric import entry

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

SECTIONS = (FLEET, SHARDS)  # each in its own place in catalog.py
METRICS = FLEET + SHARDS
