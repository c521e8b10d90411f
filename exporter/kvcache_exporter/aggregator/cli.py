"""`kvcache-exporter aggregate`: the fleet view of one model pool. See docs/fleet.md.

Its flags, environment twins (KVCACHE_AGGREGATE_<FLAG>), --config.file and --check-config come
from config.AGGREGATE_OPTIONS through the same code as `serve`'s; service.py runs it."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from functools import partial

from .. import config, service
from ..config import ConfigError, add_options, resolve_aggregate
from ..fleet_publish import NatsOptions
from ..settings import AggregateSettings
from .descriptors import raise_open_file_limit
from .discovery import DnsSd, FileSd, StaticSd, parse_flag
from .fleet_residency import FleetResidency, HashRange
from .nats_intake import DeltaIntake, NatsIntake
from .pool import Aggregator, PoolSettings

log = logging.getLogger("kvcache_exporter.aggregate")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "aggregate",
        help="the fleet view of a pool: misses another replica could have served, duplicate blocks",
        description=__doc__,
    )
    add_options(parser, config.AGGREGATE_OPTIONS)  # with every source registered for it (kit.py)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    return service.main(
        args, config.AGGREGATE_OPTIONS, partial(resolve_aggregate, check=discoveries_from), build
    )


def settings_from(
    args: argparse.Namespace, environ: dict[str, str] | None = None
) -> tuple[PoolSettings, list]:
    """A parsed command line (and environment) as the poll loop's settings and discoveries."""
    flags = {o.key: getattr(args, o.attr) for o in config.AGGREGATE_OPTIONS}
    s = resolve_aggregate(flags, {} if environ is None else environ, args.config_file)
    return pool_settings(s), discoveries_from(s)


def pool_settings(s: AggregateSettings) -> PoolSettings:
    index, _, count = s.fleet_shard.partition("/")
    return PoolSettings(
        windows=tuple(sorted(s.collect_windows)),
        interval=s.collect_interval,
        max_replicas=s.replica_max,
        max_blocks_per_replica=s.replica_max_blocks,
        hash_range=HashRange(s.fleet_hash_sampling, int(index), int(count)),
        topic=s.kv_events_topic,
        timeout=s.vllm_timeout,
        max_body_bytes=s.vllm_max_body_bytes,
        max_batches_per_second=s.kv_events_max_batches_per_second,
        kv_events_discovery=s.kv_events_discovery == "on",
        kv_sources_every=s.discovery_refresh_interval,
        source_options=s.source_options,
    )


def discoveries_from(s: AggregateSettings) -> list:
    """Where the replicas are; ConfigError with every malformed --replica or --discovery.dns."""
    problems, static = [], []
    for value in s.replica_targets:
        try:
            static.append(parse_flag(value, s.replica_kv_events_port))
        except ValueError as err:
            problems.append(f"--replica: {err}")
    discoveries: list = [StaticSd(static)] if s.replica_targets else []
    if s.discovery_file_sd:
        discoveries.append(FileSd(s.discovery_file_sd, s.replica_kv_events_port))
    if s.discovery_dns:
        try:
            discoveries.append(DnsSd(s.discovery_dns, s.replica_kv_events_port, s.discovery_refresh_interval))
        except ValueError as err:
            problems.append(f"--discovery.dns: {err}")
    if problems:
        raise ConfigError(*problems)
    return discoveries


def build(s: AggregateSettings) -> Aggregator:
    """The pool, its engine built from its rows (rows.py), as server.build_exporter builds serve's."""
    limit = raise_open_file_limit()
    log.info("open-file limit %d (KV events: a descriptor a replica, two where replicas share an IP)", limit)
    return Aggregator(
        pool_settings(s), discoveries_from(s), intake=nats_intake(s) if s.fleet_source else None
    )


def nats_intake(s: AggregateSettings) -> Callable[[FleetResidency], NatsIntake]:
    """`--fleet.source`: the shard's part of the pool from NATS JetStream, into the fleet view (made
    when the fleet_source row is wired: rows.wire_intake)."""
    assert s.fleet_source is not None
    options = NatsOptions(
        s.fleet_source, s.fleet_credentials_file, s.fleet_nkey_seed_file, s.fleet_tls_ca_file
    )
    index, _, count = s.fleet_shard.partition("/")
    retention = max(s.collect_windows) + 2 * s.collect_interval

    def make(fleet: FleetResidency) -> NatsIntake:
        intake = DeltaIntake(fleet, s.fleet_pool, s.fleet_subject_prefix, s.replica_max, retention)
        shard = (int(index), int(count))
        return NatsIntake(
            options, intake, shard, s.fleet_retention, s.fleet_max_bytes, replicas=s.fleet_stream_replicas
        )

    return make
