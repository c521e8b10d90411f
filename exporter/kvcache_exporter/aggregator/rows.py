"""`aggregate`: its sources as rows (kit.SourceKit), as server.ROWS is `serve`'s, run by the one
poll engine (kit.engine, collector.Exporter) with the pool (pool.Aggregator) as their state.

Each row declares its options and catalog entries (fleet_view_kit.py; config.AGGREGATE_OPTIONS
concatenates them, then the options aggregate shares with serve) and is wired into its part of the
pool: the replicas (discovery's polls start every round; pool.refresh adds one /metrics poll per
replica found, as many at once as the open-file budget allows), the KV-event intake (one ZMQ
FleetEvents, drained between polls by pool.drain_all), the NATS intake (--fleet.source) and the
fleet view's derivation table (pool_samples.py)."""

from __future__ import annotations

from typing import Any

from .. import fleet_view_kit
from ..collector import Poll
from ..config import shared
from ..kit import SourceKit
from . import pool_samples
from .events import FleetEvents

# Per replica, hashes queued between two drains (the rest dropped, budget_exceeded): ~4 s of a
# saturated H200 (stored + removed), so a slow /metrics poll loses none; ~14 MiB at most.
PENDING_HASHES = 131_072


def wire_replicas(s: Any, pool: Any) -> list[Poll]:
    """Each discovery's poll (where the replicas are now); its failure is its own health series."""
    return [Poll(d, d.into) for d in pool.discovered]


def wire_events(s: Any, pool: Any) -> list[Poll]:
    """Every replica's KV events through one FleetEvents (one ZMQ context, a few sockets, one thread)."""
    pool.events = FleetEvents(s.topic, s.max_batches_per_second, PENDING_HASHES)
    return []


def wire_intake(s: Any, pool: Any) -> list[Poll]:
    """`--fleet.source`: the shard's part of the pool from NATS JetStream, into the fleet view."""
    pool.intake = pool.make_intake(pool.fleet) if pool.make_intake is not None else None
    return []


ROWS: tuple[SourceKit, ...] = (
    SourceKit(
        "replicas",
        options=fleet_view_kit.REPLICAS_OPTIONS
        + shared("kv_events.discovery", "vllm.timeout", "vllm.max_body_bytes"),
        wire=wire_replicas,
        timeout=lambda s: s.timeout + 1,
    ),
    SourceKit(
        "kv_events", options=shared("kv_events.topic", "kv_events.max_batches_per_second"), wire=wire_events
    ),
    SourceKit("fleet_source", fleet_view_kit.SHARDS, fleet_view_kit.SOURCE_OPTIONS, wire_intake),
    SourceKit(
        "fleet_view", fleet_view_kit.FLEET, fleet_view_kit.VIEW_OPTIONS, derivations=pool_samples.DERIVATIONS
    ),
)
