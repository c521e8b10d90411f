"""The HTTP side: landing page, /metrics, /healthz, /readyz; TLS and basic auth from webconfig.py."""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Callable

import bcrypt
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from .exposition import render
from .webconfig import WebConfig, load_web_config

__all__ = ["WebConfig", "load_web_config", "make_app"]


@functools.lru_cache(maxsize=256)
def _bcrypt_ok(password: bytes, hashed: bytes) -> bool:
    # bcrypt is slow on purpose; Prometheus scrapes every few seconds with the same credentials.
    try:
        return bcrypt.checkpw(password, hashed)
    except ValueError:
        return False


def _authorized(request: web.Request, users: dict[str, bytes]) -> bool:
    header = request.headers.get("Authorization", "")
    if not header.startswith("Basic "):
        return False
    try:
        user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return False
    hashed = users.get(user)
    return _bcrypt_ok(password.encode(), hashed or _DUMMY) and hashed is not None


_DUMMY = bcrypt.hashpw(b"dummy", bcrypt.gensalt(rounds=4))  # equal work for unknown users
# Kubelet probes carry no credentials; these two answer ok/ready and reveal nothing else.
AUTH_EXEMPT = frozenset({"/healthz", "/readyz"})

LANDING = """<!doctype html><html><head><title>kvcache-exporter</title></head><body>
<h1>kvcache-exporter</h1><p>Prometheus sidecar for vLLM's KV (prefix) cache.</p>
<ul><li><a href="{path}">Metrics</a></li><li><a href="/healthz">Health</a></li>
<li><a href="/readyz">Readiness</a></li></ul></body></html>"""


def make_app(
    registry: CollectorRegistry, *, telemetry_path: str, ready: Callable[[], bool], users: dict[str, bytes]
) -> web.Application:
    @web.middleware
    async def auth(request: web.Request, handler):
        if users and request.path not in AUTH_EXEMPT and not _authorized(request, users):
            return web.Response(status=401, headers={"WWW-Authenticate": 'Basic realm="kvcache-exporter"'})
        return await handler(request)

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
    app.router.add_get("/", landing)
    app.router.add_get(telemetry_path, metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
