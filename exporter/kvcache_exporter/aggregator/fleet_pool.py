"""The pool's numbers from every replica's /metrics and the fleet residency view. Pure, no I/O.

Per replica, the aggregator keeps one history of its vLLM counters (`query_tokens`, `hit_tokens`,
summed over engines) and one of its fleet counters (`other_replica_blocks`, `stored_blocks`, scaled
by 1/sampling), converted to tokens with the replica's block size from `cache_config_info`. The
affinity estimate over a window is the pool's hit ratio had every request gone to a replica holding
its prefix: (hits + other_replica miss tokens) / queries, beside the real ratio hits / queries.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .. import catalog as c
from ..derive.cache import hit_ratio
from ..derive.windows import Delta
from ..fleet_wire import block_size as block_size  # the aggregator reads them here
from ..fleet_wire import replica_counters as replica_counters
from ..samples import Sample
from ..sources.vllm_snapshot import EngineSample
from .fleet_residency import FleetResidency, ReplicaView
from .fleet_sessions import split_ratio


def fleet_counters(view: ReplicaView, scale: float) -> EngineSample:
    """A replica's fleet counters in blocks, scaled from the hash sample to the whole stream."""
    return EngineSample(
        counters={"other_replica_blocks": view.other_replica * scale, "stored_blocks": view.stored * scale}
    )


@dataclass(frozen=True)
class PoolWindow:
    hits: float
    queries: float
    other_replica: float

    @property
    def real(self) -> float | None:
        return hit_ratio(self.hits, self.queries)

    @property
    def estimate(self) -> float | None:
        """Bounded by 1: a decode block another replica also holds is no prompt token of a query."""
        return hit_ratio(self.hits + self.other_replica, self.queries)


ReplicaWindow = tuple[Delta | None, Delta | None, int | None]  # vLLM delta, fleet delta, block size


def pool_window(replicas: Iterable[ReplicaWindow], slice_scale: float = 1.0) -> PoolWindow:
    """Sum over replicas; `slice_scale` stretches a shard's slice of the hash space to all of it
    (`shards` for a shard, 1 for one aggregator). A replica needs both deltas and a block size."""
    hits = queries = other = 0.0
    for vllm, fleet, size in replicas:
        if vllm is None or fleet is None or not size:
            continue
        hits += max(vllm.counters.get("hit_tokens", 0.0), 0.0)
        queries += max(vllm.counters.get("query_tokens", 0.0), 0.0)
        other += max(fleet.counters.get("other_replica_blocks", 0.0), 0.0) * size * slice_scale
    return PoolWindow(hits, queries, other)


def window_samples(window: str, pool: PoolWindow) -> list[Sample]:
    out = []
    if pool.real is not None:
        out.append(Sample(c.FLEET_HIT_RATIO, {"window": window}, pool.real))
    if pool.estimate is not None:
        labels = {"window": window, "routing": "prefix_affinity"}
        out.append(Sample(c.FLEET_HIT_RATIO_ESTIMATE, labels, pool.estimate))
    return out


def residency_samples(fleet: FleetResidency, block_sizes: dict[str, int | None]) -> list[Sample]:
    """Per replica counters and pool gauges, scaled by 1/sampling. Token counters need the block
    size: until /metrics has told it, they are absent rather than wrong."""
    scale = fleet.scale
    out = [
        Sample(c.FLEET_HASH_SAMPLING_RATIO, {}, fleet.hash_range.sampling),
        Sample(c.FLEET_DISTINCT_BLOCKS, {}, fleet.distinct * scale),
        Sample(c.FLEET_DUPLICATE_BLOCKS, {}, fleet.duplicates * scale),
    ]
    if fleet.distinct:
        out.append(Sample(c.FLEET_DUPLICATE_BLOCKS_RATIO, {}, fleet.duplicates / fleet.distinct))
    for name, view in fleet.replicas.items():
        replica, size = {"replica": name}, block_sizes.get(name)
        if size:
            tokens = size * scale
            out += [
                Sample(
                    c.PREFIX_CACHE_MISS_TOKENS_TOTAL,
                    {**replica, "cause": "other_replica"},
                    view.other_replica * tokens,
                ),
                Sample(c.FLEET_STORED_TOKENS_TOTAL, replica, view.stored * tokens),
            ]
        out += [
            Sample(c.FLEET_RESIDENT_BLOCKS, replica, view.resident * scale),
            Sample(c.FLEET_UNTRACKED_BLOCKS_TOTAL, replica, view.overflow * scale),
            Sample(c.FLEET_REPLICA_RESTARTS_TOTAL, replica, view.restarts),
        ]
    return out


def session_samples(sessions: int, splits: int) -> list[Sample]:
    """Absent until an event carries a session id: no ids is unknown, never 0."""
    ratio = split_ratio(sessions, splits)
    if ratio is None:
        return []
    return [
        Sample(c.FLEET_SESSIONS, {}, float(sessions)),
        Sample(c.FLEET_SESSIONS_SPLIT, {}, float(splits)),
        Sample(c.FLEET_SESSIONS_SPLIT_RATIO, {}, ratio),
    ]
