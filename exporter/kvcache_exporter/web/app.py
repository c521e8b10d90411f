"""The HTTP side: landing page, /metrics, /healthz, /readyz, opt-in debug pages; TLS and basic auth
from config.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..exposition import families, render
from .auth import Authenticator
from .config import WebConfig, load_web_config
from .listener import CONNECTIONS, REJECTIONS, Connection, ConnectionLimits, Connections, Rejections, listen

__all__ = ["AUTH_EXEMPT", "ConnectionLimits", "WebConfig", "listen", "load_web_config", "make_app"]

# Kubelet probes carry no credentials; these two answer ok/ready and reveal nothing else.
AUTH_EXEMPT = frozenset({"/healthz", "/readyz"})
_CHALLENGE = {"WWW-Authenticate": 'Basic realm="kvcache-exporter"'}

LANDING = """<!doctype html><html><head><title>kvcache-exporter</title></head><body>
<h1>kvcache-exporter</h1><p>Prometheus sidecar for vLLM's KV (prefix) cache.</p>
<ul><li><a href="{path}">Metrics</a></li><li><a href="/healthz">Health</a></li>
<li><a href="/readyz">Readiness</a></li></ul></body></html>"""


class _RejectionCollector(Collector):
    def __init__(self, rejections: Rejections):
        self.rejections = rejections

    def collect(self) -> Iterable[Metric]:
        return families(self.rejections.samples())


def make_app(
    registry: CollectorRegistry,
    *,
    telemetry_path: str,
    ready: Callable[[], bool],
    users: Mapping[str, bytes],
    headers: Mapping[str, str] | None = None,
    authenticator: Authenticator | None = None,
    debug_pages: Mapping[str, Callable[[], object]] | None = None,
) -> web.Application:
    """`debug_pages`: path -> a JSON report, opt-in pages (e.g. /debug/fields), behind the same auth."""
    rejections, connections = Rejections(), Connections()
    registry.register(_RejectionCollector(rejections))
    checker = authenticator or (Authenticator(users) if users else None)

    @web.middleware
    async def auth(request: web.Request, handler):
        # A connection with a request in flight is never evicted; one that made an authorized
        # request is evicted last (listener.victim).
        connection = connections.find(request.transport) or Connection("", 0.0, lambda: None)
        connection.busy += 1
        try:
            if checker and request.path not in AUTH_EXEMPT:
                header = request.headers.get("Authorization", "")
                verdict = await checker.check(header, request.remote or "")
                if verdict == "busy":
                    rejections.count("auth_busy")
                    return web.Response(status=429, headers={"Retry-After": "1"})
                if verdict != "ok":
                    return web.Response(status=401, headers=_CHALLENGE)
            connection.proven = connection.proven or not checker or request.path not in AUTH_EXEMPT
            response = await handler(request)
        finally:
            connection.busy -= 1
            connection.last_active = connections.clock()
        response.headers.update(headers or {})
        return response

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def landing(_: web.Request) -> web.Response:
        return web.Response(text=LANDING.format(path=telemetry_path), content_type="text/html")

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        if ready():
            return web.Response(text="ready\n")
        return web.Response(status=503, text="no successful poll of vLLM yet\n")

    app = web.Application(middlewares=[auth], client_max_size=64 * 1024)
    app[REJECTIONS], app[CONNECTIONS] = rejections, connections
    if checker:
        app.on_cleanup.append(lambda _: _close(checker))
    app.router.add_get("/", landing)
    app.router.add_get(telemetry_path, metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    for path, report in (debug_pages or {}).items():
        app.router.add_get(path, _json_page(report))
    return app


def _json_page(report: Callable[[], object]):
    async def page(_: web.Request) -> web.Response:
        return web.json_response(report())

    return page


async def _close(checker: Authenticator) -> None:
    checker.close()
