"""The process around a poll loop, the same for `serve` and `aggregate`: settings from an option
table (flags, environment, --config.file, --check-config), every configuration problem on stderr
as `kvcache-exporter: location: message` (exit 2), the HTTP endpoint, signals and shutdown."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any, Protocol

from . import logs
from .config import ConfigError, Option
from .exposition import registry_for
from .samples import Sample
from .settings import ServiceSettings
from .web.app import ConnectionLimits, listen, load_web_config, make_app

log = logging.getLogger("kvcache_exporter")
CONFIG_ERROR_EXIT = 2


class PollLoop(Protocol):
    latest: list[Sample]
    ready: bool

    async def run(self, stop: asyncio.Event) -> None: ...

    async def close(self) -> None: ...


Resolve = Callable[[dict[str, Any], dict[str, str], str | None], ServiceSettings]
Build = Callable[[Any], PollLoop]


def main(
    args: argparse.Namespace,
    options: tuple[Option, ...],
    resolve: Resolve,
    build: Build,
) -> int:
    """Resolve and check (what start-up would reject, without starting), then run until a signal."""
    flags = {o.key: getattr(args, o.attr) for o in options}
    try:
        settings = resolve(flags, dict(os.environ), args.config_file)
        load_web_config(settings.web_config_file)  # run() loads it again itself
        if args.check_config:
            print("configuration OK")
            return 0
        return asyncio.run(run(settings, build))
    except ConfigError as err:  # also what only start-up can find, e.g. the port is taken
        for problem in err.problems:
            print(f"kvcache-exporter: {problem}", file=sys.stderr)
        return CONFIG_ERROR_EXIT


def settle_gc() -> None:
    """What start-up built lives as long as the process: frozen, so no full collection walks it
    again; and a young collection every 10,000 allocations, not 700 (a poll of 100 targets makes
    ~50,000 objects: 12 young and one full collection a poll, a sixth of its CPU, were the default).
    Cycles are still collected; the young generation holds at most 10,000 objects more."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(10_000, 10, 10)


async def run(s: ServiceSettings, build: Build) -> int:
    """Serve `build(s)`'s samples until SIGINT/SIGTERM."""
    logs.setup(s.log_level, s.log_format)
    web_config = load_web_config(s.web_config_file)
    loop = build(s)  # inside the event loop: sources may start tasks and threads
    app = make_app(
        registry_for(lambda: loop.latest),
        telemetry_path=s.web_telemetry_path,
        ready=lambda: loop.ready,
        users=web_config.users,
        headers=web_config.headers,
        debug_pages=getattr(loop, "debug_pages", None),  # serve's opt-in /debug/fields
    )
    limits = ConnectionLimits(s.web_max_connections, s.web_idle_timeout, s.web_tls_handshake_timeout)
    try:
        listener = await listen(app, s.web_listen_address, web_config.ssl_context, limits)
    except ConfigError:
        await loop.close()
        raise
    log.info("listening", extra={"address": s.web_listen_address, "tls": web_config.ssl_context is not None})
    settle_gc()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await loop.run(stop)
    finally:
        await loop.close()
        await listener.close()
        log.info("stopped")
    return 0
