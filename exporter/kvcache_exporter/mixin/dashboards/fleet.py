"""kvcache-fleet: what `kvcache-exporter aggregate` sees across a pool of replicas (its own
dashboard: a single vLLM's dashboards stay free of panels that are empty without an aggregator).

Queries sum the aggregator's shards: its own counters add up; vLLM's counters, which every shard
polls alike, are taken once per replica (`max by (replica)`), as the recording rules do.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import units

from .common import BATCHES_PER_SECOND, RATE, TOKENS_PER_SECOND, Query, dashboard, graph, ratio, sel

FAILED_RESYNCS = sel("kvcache_fleet_publish_resyncs_total", 'result="failed"')

UID = "kvcache-fleet"

OTHER = sel("kvcache_prefix_cache_miss_tokens_total", 'cause="other_replica"')
AFFINITY = ("KVCacheAffinityLoss",)
DELTAS_PER_SECOND = "suffix: deltas/s"


def _per_replica(metric: str) -> str:
    return f"sum(max by (replica) (rate({sel(metric)}[{RATE}])))"


def panels():
    hits, queries = (
        _per_replica("kvcache_fleet_hit_tokens_total"),
        _per_replica("kvcache_fleet_query_tokens_total"),
    )
    other = f"sum(rate({OTHER}[{RATE}]))"
    return [
        graph(
            "Tokens another replica held, per replica",
            Query(f"sum by (replica) (rate({OTHER}[{RATE}]))", "{{replica}} other_replica"),
            Query(
                f"sum by (replica) (rate({sel('kvcache_fleet_stored_tokens_total')}[{RATE}]))",
                "{{replica}} computed",
            ),
            shows="Per replica: tokens it computed (BlockStored) per second, and those that another replica "
            "of the pool held at that moment (other_replica misses).",
            action="other_replica a large part of computed on every replica: requests sharing a prefix are "
            "spread over replicas; route by session or prefix (runbook).",
            alerts=AFFINITY,
            unit=TOKENS_PER_SECOND,
        ),
        graph(
            "Pool hit ratio: real vs with prefix affinity",
            Query(ratio(hits, queries), "real"),
            Query(f"clamp_max({ratio(f'{hits} + {other}', queries)}, 1)", "prefix-affinity estimate"),
            shows="The pool's hit ratio (hits / queries of every replica) and what it would be if every "
            "request had gone to a replica holding its prefix: (hits + other_replica tokens) / queries, an "
            "upper bound.",
            action="A wide gap is what affinity routing would win; no gap: routing is already affine, look "
            "at the per-replica causes (evicted, prefix_diverged) instead.",
            alerts=AFFINITY,
            unit=units.PercentUnit,
        ),
        graph(
            "Sessions split across replicas (ground truth)",
            Query(f"max({sel('kvcache_fleet_sessions_split_ratio')})", "split sessions"),
            shows="Where requests carry a session id (vLLM 0.32+ puts it on BlockStored): the share of "
            "recent sessions whose blocks were stored on two or more replicas. No data without session ids; "
            "every aggregator shard reports the same figure.",
            action="High: the router splits sessions; with a wide gap between the real and the affinity hit "
            "ratio, sticky session routing wins it. 0 with a gap: the prefix is shared across sessions.",
            alerts=AFFINITY,
            unit=units.PercentUnit,
        ),
        graph(
            "Blocks held by two or more replicas",
            Query(
                ratio(
                    f"sum({sel('kvcache_fleet_duplicate_blocks')})",
                    f"sum({sel('kvcache_fleet_distinct_blocks')})",
                ),
                "duplicate share",
            ),
            shows="Share of the pool's distinct resident KV blocks that two or more replicas hold at once: "
            "KV memory spent twice (scaled by the aggregator's hash sampling).",
            action="High with a high other_replica share: affinity routing frees that memory too. High "
            "alone: a prefix every replica needs (a system prompt), expected.",
            alerts=AFFINITY,
            unit=units.PercentUnit,
        ),
        graph(
            "Aggregator health per replica",
            Query(f"sum by (replica) ({sel('kvcache_vllm_up')})", "{{replica}} /metrics up"),
            Query(
                f"sum by (replica) (rate({sel('kvcache_kv_events_batches_total')}[{RATE}]))",
                "{{replica}} batches/s",
                unit=BATCHES_PER_SECOND,
            ),
            Query(
                f"sum by (replica) (rate({sel('kvcache_kv_events_missed_batches_total')}[{RATE}]))",
                "{{replica}} missed/s",
                unit=BATCHES_PER_SECOND,
            ),
            shows="Per replica, as the aggregator sees it: its /metrics poll (1 = up), KV-event batches "
            "received and lost per second.",
            action="No batches from a replica with traffic: its vLLM publishes on a concrete (connect-style) "
            "endpoint, which only the sidecar can receive: use tcp://*:5557 (docs/fleet.md).",
            alerts=("KVCacheEventsMissed", "KVCacheVLLMDown"),
        ),
        graph(
            "Aggregator up",
            Query(
                f"max by (instance) ({sel('up')} and on (job, instance) "
                f"last_over_time({sel('kvcache_fleet_distinct_blocks')}[1d]))",
                "{{instance}}",
            ),
            shows="Whether Prometheus can scrape each fleet aggregator seen in the last day (1 = up): the "
            "process behind every panel of this row.",
            action="0 or gone: the fleet view is blind; see the aggregator's log and its pod (runbook).",
            alerts=("KVCacheAggregatorDown", "KVCacheAggregatorAbsent"),
        ),
        graph(
            "On NATS JetStream: sidecars publishing",
            Query(
                f"sum by (replica) (rate({sel('kvcache_fleet_published_total')}[{RATE}]))",
                "{{replica}} published/s",
            ),
            Query(
                f"sum by (replica) (rate({sel('kvcache_fleet_publish_dropped_total')}[{RATE}]))",
                "{{replica}} dropped/s",
            ),
            Query(
                f"max by (replica) ({sel('kvcache_fleet_publish_lag_seconds')})", "{{replica}} lag", unit="s"
            ),
            Query(
                f"sum by (replica) (rate({FAILED_RESYNCS}[{RATE}]))",
                "{{replica}} failed resyncs/s",
            ),
            shows="With --fleet.publish: each sidecar's residency deltas sent to NATS per second, those it "
            "dropped (its bounded buffer full, NATS away), how old its oldest unsent delta is, and "
            "resyncs from vLLM's replay after an outage that failed.",
            action="Drops, a growing lag or failed resyncs: NATS is unreachable or slow from that sidecar; "
            "the shards mark the gap as missed until the replica stores its blocks again (runbook).",
            alerts=("KVCacheFleetPublishDropping", "KVCacheFleetPublishLagging", "KVCacheFleetResyncFailed"),
            unit=DELTAS_PER_SECOND,
        ),
        graph(
            "On NATS JetStream: shards consuming",
            Query(f"sum by (instance) ({sel('kvcache_fleet_consumer_pending')})", "{{instance}} pending"),
            Query(
                f"sum by (instance) (rate({sel('kvcache_fleet_consumer_redelivered_total')}[{RATE}]))",
                "{{instance}} redelivered/s",
                unit=DELTAS_PER_SECOND,
            ),
            shows="With --fleet.source: deltas waiting in each shard's durable consumer, and those NATS "
            "delivered again (a shard that did not acknowledge in time).",
            action="Pending growing: the shard cannot keep up; add shards (--fleet.shard K/N) or CPU. "
            "Redeliveries: the shard is stalling or restarting (runbook).",
            alerts=("KVCacheFleetConsumerLagging", "KVCacheFleetRedeliveries"),
        ),
    ]


def build() -> db.Dashboard:
    return dashboard(
        UID,
        "KV cache / Fleet",
        "A pool of replicas: misses another replica could serve, blocks held twice.",
        {"Fleet": panels()},
    )
