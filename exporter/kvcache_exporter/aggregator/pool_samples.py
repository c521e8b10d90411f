"""The aggregator's derivation table (its fleet_view row's: rows.py): what /metrics serves, as
functions of the pool (pool.py) and its settings, run by serve's engine (collector.Exporter) one by
one, so a bug in one costs only its own series. Each replica's poll health (collector="vllm")
comes from the engine itself."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

from .. import catalog as c
from ..durations import window_label
from ..samples import Sample
from . import fleet_pool
from .fleet_residency import FleetResidency


class Pool(Protocol):
    """What the derivations read of the aggregator (pool.Aggregator): a protocol, so that this
    module does not import pool.py, which imports it."""

    members: dict[str, Any]
    intake: Any
    fleet: FleetResidency
    left_out: int
    fd_exhausted: Counter[str]

    def streams_healthy(self, member: Any) -> bool: ...


def residency(pool: Pool, settings: Any) -> list[Sample]:
    sizes = {name: member.block_size for name, member in pool.members.items()}
    if pool.intake is not None:
        sizes |= pool.intake.intake.block_sizes()
    out = fleet_pool.residency_samples(pool.fleet, sizes)
    return out + fleet_pool.session_samples(*pool.fleet.sessions.counts())


def windows(pool: Pool, settings: Any) -> list[Sample]:
    out: list[Sample] = []
    slice_scale = float(settings.hash_range.shards)
    for seconds in settings.windows:
        replicas = [
            (m.vllm_history.window(seconds), m.fleet_history.window(seconds), m.block_size)
            for m in pool.members.values()
        ]
        if pool.intake is not None:
            replicas += pool.intake.intake.windows(seconds)
        out += fleet_pool.window_samples(window_label(seconds), fleet_pool.pool_window(replicas, slice_scale))
    return out


def health(pool: Pool, settings: Any) -> list[Sample]:
    watched = len(pool.members) if pool.intake is None else len(pool.fleet.replicas)
    out = [Sample(c.FLEET_REPLICAS, {}, float(watched))]
    if pool.intake is not None:
        out += pool.intake.samples()
    for name, member in pool.members.items():
        count = len(member.replica.kv_events_ranks or ())  # the ranks followed as its vLLM says
        out.append(Sample(c.KV_EVENTS_DISCOVERED_ENDPOINTS, {"replica": name}, float(count)))
    out.append(Sample(c.FLEET_REPLICAS_LEFT_OUT, {}, float(pool.left_out)))
    for name, member in pool.members.items():
        replica = {"replica": name}
        out.append(Sample(c.VLLM_UP, replica, float(member.up)))
        if member.up:
            out += [
                Sample(c.FLEET_QUERY_TOKENS_TOTAL, replica, member.counters["query_tokens"]),
                Sample(c.FLEET_HIT_TOKENS_TOTAL, replica, member.counters["hit_tokens"]),
            ]
        out += event_health(pool, replica, member)
    return out


def event_health(pool: Pool, replica: dict[str, str], member: Any) -> list[Sample]:
    view, streams = pool.fleet.replicas.get(replica["replica"]), member.replica.streams()
    if not streams or view is None:
        return []
    success = float(pool.streams_healthy(member))
    collector = {**replica, "collector": "kv_events"}
    out = [
        Sample(c.EXPORTER_COLLECTOR_SUCCESS, collector, success),
        Sample(c.KV_EVENTS_BATCHES_TOTAL, replica, view.batches),
        Sample(c.KV_EVENTS_MISSED_BATCHES_TOTAL, replica, view.missed),
        *(
            Sample(c.KV_EVENTS_DROPPED_TOTAL, {**replica, "reason": reason}, n)
            for reason, n in member.dropped.items()
        ),
    ]
    if refused := pool.fd_exhausted.get(replica["replica"]):  # polls it went unsubscribed
        out.append(Sample(c.EXPORTER_ERRORS_TOTAL, {**collector, "reason": "fd_exhausted"}, refused))
    return out


DERIVATIONS: dict[str, Callable[[Pool, Any], list[Sample]]] = {
    "residency": residency,
    "windows": windows,
    "health": health,
}
