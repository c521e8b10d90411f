"""`kvcache-exporter aggregate`: the fleet view of one model pool. See docs/fleet.md."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping

from .. import logs
from ..config import ConfigError, duration, listen_address, window_label
from ..exposition import registry_for
from ..web.app import Limits, listen, load_web_config, make_app
from .discovery import DEFAULT_KV_EVENTS_PORT, DnsSd, FileSd, StaticSd, parse_flag
from .fleet_residency import HashRange
from .pool import AggregateSettings, Aggregator

log = logging.getLogger("kvcache_exporter.aggregate")


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "aggregate",
        help="the fleet view of a pool: misses another replica could have served, duplicate blocks",
        description=__doc__,
    )
    add = parser.add_argument
    add("--web.listen-address", dest="listen", default=":9401", type=listen_address)
    add("--web.telemetry-path", dest="telemetry_path", default="/metrics")
    add("--web.config.file", dest="web_config_file", help="TLS / basic auth (exporter-toolkit format)")
    add("--replica", action="append", default=[], help="TARGET[,KV_ENDPOINT], repeatable (host:port or URL)")
    add("--discovery.file-sd", dest="file_sd", help="Prometheus file_sd JSON/YAML file, re-read on change")
    add("--discovery.dns", dest="dns", help="NAME:PORT of a headless Service (A/AAAA records)")
    add("--discovery.refresh-interval", dest="refresh", type=duration, default=30.0, help="DNS re-resolve")
    add("--replica.kv-events-port", dest="kv_port", type=int, default=DEFAULT_KV_EVENTS_PORT)
    add("--replica.max", dest="max_replicas", type=int, default=64, help="replicas watched at most")
    add("--replica.max-blocks", dest="max_blocks", type=int, default=AggregateSettings.max_blocks_per_replica)
    add("--fleet.hash-sampling", dest="sampling", type=float, default=1.0, help="fraction of hashes kept")
    add("--fleet.shard", dest="shard", default="0/1", help="K/N: keep the K-th of N hash ranges")
    add("--kv-events.topic", dest="topic", default="", help="ZMQ topic prefix ('' = every topic)")
    add("--collect.interval", dest="interval", type=duration, default=5.0)
    add("--collect.windows", dest="windows", default="5m,1h")
    add("--log.level", dest="log_level", default="info", choices=("debug", "info", "warn", "error"))
    add("--log.format", dest="log_format", default="logfmt", choices=("logfmt", "json"))
    with_environment_twins(parser, os.environ)
    parser.set_defaults(func=run)
    return parser


def with_environment_twins(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Every flag's default from KVCACHE_AGGREGATE_<FLAG> (`--discovery.dns` -> KVCACHE_AGGREGATE_
    DISCOVERY_DNS). A flag on the command line wins; a repeated flag (`--replica`, whitespace-separated
    in the environment) adds to the environment's values."""
    for action in parser._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or action.dest == "help":
            continue
        env = "KVCACHE_AGGREGATE_" + flag[2:].replace(".", "_").replace("-", "_").upper()
        action.help = f"{action.help or ''} (env {env})".strip()
        if env in environ:
            action.default = (
                environ[env].split() if isinstance(action, argparse._AppendAction) else environ[env]
            )


def settings_from(args: argparse.Namespace) -> tuple[AggregateSettings, list]:
    shard, _, shards = args.shard.partition("/")
    settings = AggregateSettings(
        windows=tuple(sorted(duration(w) for w in args.windows.split(",") if w)),
        interval=args.interval,
        max_replicas=args.max_replicas,
        max_blocks_per_replica=args.max_blocks,
        hash_range=HashRange(args.sampling, int(shard), int(shards or 1)),
        topic=args.topic,
    )
    discoveries: list = []
    if args.replica:
        discoveries.append(StaticSd([parse_flag(value, args.kv_port) for value in args.replica]))
    if args.file_sd:
        discoveries.append(FileSd(args.file_sd, args.kv_port))
    if args.dns:
        discoveries.append(DnsSd(args.dns, args.kv_port, args.refresh))
    if not discoveries:
        raise ValueError("name the replicas: --replica, --discovery.file-sd or --discovery.dns")
    return settings, discoveries


def run(args: argparse.Namespace) -> int:
    try:
        settings, discoveries = settings_from(args)
    except ValueError as err:
        print(f"aggregate: {err}")
        return 2
    logs.setup(args.log_level, args.log_format)
    try:
        return asyncio.run(serve(args, settings, discoveries))
    except ConfigError as err:  # the web-config file, or the port is taken
        print(f"aggregate: {err}")
        return 2


async def serve(args: argparse.Namespace, settings: AggregateSettings, discoveries: list) -> int:
    web_config = load_web_config(args.web_config_file)
    aggregator = Aggregator(settings, discoveries)
    app = make_app(
        registry_for(lambda: aggregator.latest),
        telemetry_path=args.telemetry_path,
        ready=lambda: aggregator.ready,
        users=web_config.users,
        headers=web_config.headers,
    )
    try:  # the same bounds on connections, handshakes and idle time as `serve`
        listener = await listen(app, args.listen, web_config.ssl_context, Limits())
    except ConfigError:
        await aggregator.close()
        raise
    windows = ",".join(window_label(w) for w in settings.windows)
    log.info("aggregating", extra={"address": args.listen, "windows": windows})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await aggregator.run(stop)
    finally:
        await aggregator.close()
        await listener.close()
    return 0
