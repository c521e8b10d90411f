"""`serve`: wire settings into sources, the poll loop and the HTTP server, then run until a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from types import SimpleNamespace
from urllib.parse import urlsplit

from aiohttp import web

from . import logs
from .collector import Exporter, Target
from .exposition import registry_for
from .fleet import Fleet, pricing_from
from .sources.base import Sample
from .sources.gpu import NoGpuSource, make_gpu_source
from .sources.kv_events import KvEventSubscriber
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
    gpu = make_gpu_source(
        s.gpu_source,
        devices=s.gpu_devices or None,
        max_processes=s.gpu_max_processes,
        dcgm_url=s.gpu_dcgm_url,
        pod_name=s.gpu_pod or os.environ.get("POD_NAME"),
        pod_namespace=s.gpu_namespace or os.environ.get("POD_NAMESPACE"),
        gpu_uuids=s.gpu_uuids or None,
        timeout_seconds=s.vllm_timeout,
    )
    fleet = Fleet(pricing_from(s), s.audit_gpu_memory_utilization_ceiling, retention, s.cost_gpu_count)
    extras, closers = [fleet], [gpu.close]
    # No GPU source at all (switched off, or `auto` found none): no collector, so nothing reads as failing.
    pollers = {} if isinstance(gpu, NoGpuSource) else {"gpu": gpu.collect}
    if not pollers:
        log.info("GPU telemetry off: %s", gpu.why)
    if s.kv_events_endpoint:
        subscriber = KvEventSubscriber(
            s.kv_events_endpoint,
            mode=s.kv_events_mode,
            topic=s.kv_events_topic,
            replay_endpoint=s.kv_events_replay_endpoint,
            max_batches_per_second=s.kv_events_max_batches_per_second,
        )
        subscriber.start()  # needs the running event loop: build_exporter is called from serve()
        extras.append(lambda _: kv_event_samples(subscriber))
        closers.append(subscriber.stop)
    return Exporter(
        targets,
        windows=s.collect_windows,
        quantiles=s.collect_quantiles,
        interval=s.collect_interval,
        extras=extras,
        pollers=pollers,
        closers=closers,
    )


def kv_event_samples(subscriber: KvEventSubscriber) -> list[Sample]:
    """The stream is pushed, not polled: its health is whether the socket is open and reading."""
    return [
        *subscriber.samples(),
        Sample("kvcache_exporter_collector_success", {"collector": "kv_events"}, float(subscriber.healthy)),
    ]


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
