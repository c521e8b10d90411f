"""The HTTP side: landing page, /metrics, /healthz, /readyz; TLS and basic auth from a web-config file.

The web-config file uses the Prometheus exporter-toolkit format (tls_server_config,
basic_auth_users with bcrypt hashes), so one file serves Prometheus and this exporter alike.
"""

from __future__ import annotations

import base64
import binascii
import functools
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field

import bcrypt
import yaml
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry

from .config import ConfigError
from .exposition import render

_TLS_KEYS = {"cert_file", "key_file", "client_auth_type", "client_ca_file", "min_version", "max_version"}
_CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "RequestClientCert": ssl.CERT_OPTIONAL,
    "RequireAnyClientCert": ssl.CERT_REQUIRED,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_VERSIONS = {"TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}


@dataclass
class WebConfig:
    ssl_context: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash


def load_web_config(path: str | None) -> WebConfig:
    if not path:
        return WebConfig()
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"{path}: {err}") from err
    unknown = set(data) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise ConfigError(f"{path}:{sorted(unknown)[0]}: unknown key")
    users = {str(u): str(h).encode() for u, h in (data.get("basic_auth_users") or {}).items()}
    tls = data.get("tls_server_config")
    return WebConfig(_ssl_context(path, tls) if tls else None, users)


def _ssl_context(path: str, tls: dict) -> ssl.SSLContext:
    unknown = set(tls) - _TLS_KEYS
    if unknown:
        raise ConfigError(f"{path}:tls_server_config.{sorted(unknown)[0]}: unknown key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _VERSIONS.get(tls.get("min_version", "TLS12"), ssl.TLSVersion.TLSv1_2)
    try:
        context.load_cert_chain(tls["cert_file"], tls["key_file"])
        auth = tls.get("client_auth_type", "NoClientCert")
        context.verify_mode = _CLIENT_AUTH[auth]
        if tls.get("client_ca_file"):
            context.load_verify_locations(tls["client_ca_file"])
    except KeyError as err:
        raise ConfigError(f"{path}:tls_server_config: missing or invalid {err}") from err
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"{path}:tls_server_config: {err}") from err
    return context


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
