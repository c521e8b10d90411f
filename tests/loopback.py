"""A test's own HTTP upstream (vLLM, dcgm-exporter, a hostile server) on a free loopback port."""

from __future__ import annotations

from aiohttp import web


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start `app` on 127.0.0.1 and a port the kernel picks: the runner (to clean up) and the base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"
