"""`serve`: wire settings into sources, the poll loop and the HTTP server, then run until a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
from types import SimpleNamespace
from urllib.parse import urlsplit

from aiohttp import web

from . import logs
from .collector import Exporter, Target
from .exposition import registry_for
from .sources.vllm import VllmSource
from .web import load_web_config, make_app

log = logging.getLogger("kvcache_exporter")


def build_exporter(s: SimpleNamespace) -> Exporter:
    retention = max(s.collect_windows) + 2 * s.collect_interval
    targets = [
        Target(
            urlsplit(url).netloc,
            VllmSource(url, s.vllm_timeout, s.vllm_max_body_bytes, s.vllm_bearer_token_file),
            retention,
        )
        for url in s.vllm_url
    ]
    return Exporter(
        targets, windows=s.collect_windows, quantiles=s.collect_quantiles, interval=s.collect_interval
    )


async def serve(s: SimpleNamespace) -> int:
    logs.setup(s.log_level, s.log_format)
    web_config = load_web_config(s.web_config_file)
    exporter = build_exporter(s)
    app = make_app(
        registry_for(lambda: exporter.latest),
        telemetry_path=s.web_telemetry_path,
        ready=lambda: exporter.ready,
        users=web_config.users,
    )
    host, _, port = s.web_listen_address.rpartition(":")
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host or None, int(port), ssl_context=web_config.ssl_context)
    await site.start()
    log.info(
        "listening",
        extra={
            "address": s.web_listen_address,
            "tls": web_config.ssl_context is not None,
            "targets": len(s.vllm_url),
        },
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await exporter.run(stop)
    finally:
        await exporter.close()
        await runner.cleanup()
        log.info("stopped")
    return 0
