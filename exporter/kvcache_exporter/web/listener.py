"""Our own accept loop, so connections are bounded where they cost memory: at the socket.

A half-open TLS connection held ~300 KiB; 3,000 of them took 951 MiB. Here at most
`max_connections` are open, TLS handshakes included, a handshake gets `handshake_timeout` and an
idle connection `idle_timeout` (aiohttp's keep-alive timer, which also runs before the first
request). Refused connections and malformed requests are counted in
kvcache_exporter_http_rejected_total{reason}, and logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import time
from dataclasses import dataclass

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from .. import catalog as c
from ..config import ConfigError
from ..samples import Sample

log = logging.getLogger("kvcache_exporter")
REASONS = ("too_many_connections", "tls_handshake", "header_too_large", "bad_request", "auth_busy")


@dataclass(frozen=True)
class Limits:
    max_connections: int = 256
    idle_timeout: float = 60.0
    handshake_timeout: float = 10.0


class Rejections(logging.Filter):
    """Counts by reason; one log line per reason and minute. As a filter on aiohttp's server logger
    it turns a traceback per malformed request into that count and line."""

    def __init__(self, clock=time.monotonic, every: float = 60.0):
        super().__init__()
        self.counts = dict.fromkeys(REASONS, 0)
        self.clock, self.every, self.logged = clock, every, dict.fromkeys(REASONS, -every)

    def count(self, reason: str, detail: str = "") -> None:
        self.counts[reason] += 1
        if self.clock() - self.logged[reason] >= self.every:
            self.logged[reason] = self.clock()
            log.warning("HTTP request refused", extra={"reason": reason, "detail": detail[:200]})

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if not isinstance(error, HttpProcessingError):
            return True
        self.count("header_too_large" if isinstance(error, LineTooLong) else "bad_request", str(error))
        return False

    def samples(self) -> list[Sample]:
        return [
            Sample(c.EXPORTER_HTTP_REJECTED_TOTAL, {"reason": r}, float(n)) for r, n in self.counts.items()
        ]


class Listener:
    def __init__(
        self, runner: web.AppRunner, sock: socket.socket, tls: ssl.SSLContext | None, limits: Limits
    ):
        self.runner, self.sock, self.tls, self.limits = runner, sock, tls, limits
        self.rejections: Rejections = runner.app[REJECTIONS]
        self.open = 0
        self.tasks: set[asyncio.Task] = set()
        self.accepting = asyncio.get_running_loop().create_task(self._accept())

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self.sock)
            except OSError as err:  # e.g. out of file descriptors: keep accepting once some close
                self.rejections.count("too_many_connections", repr(err))
                await asyncio.sleep(0.1)
                continue
            if self.open >= self.limits.max_connections:
                conn.close()
                self.rejections.count("too_many_connections")
                continue
            self.open += 1
            task = loop.create_task(self._serve(conn))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        closed = asyncio.get_running_loop().create_future()
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: _Tracked(self.runner.server(), closed),
                conn,
                ssl=self.tls,
                ssl_handshake_timeout=self.limits.handshake_timeout if self.tls else None,
            )
            await closed
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as err:
            conn.close()
            self.rejections.count("tls_handshake", repr(err))
        finally:
            self.open -= 1

    async def close(self) -> None:
        self.accepting.cancel()
        self.sock.close()
        logging.getLogger("aiohttp.server").removeFilter(self.rejections)
        await self.runner.cleanup()  # closes the open connections
        for task in list(self.tasks):
            task.cancel()


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, telling the listener when it closes."""

    def __init__(self, inner: asyncio.Protocol, closed: asyncio.Future):
        self.inner, self.closed = inner, closed

    def connection_made(self, transport):
        self.inner.connection_made(transport)

    def data_received(self, data):
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()

    def connection_lost(self, exc):
        self.inner.connection_lost(exc)
        if not self.closed.done():
            self.closed.set_result(None)


REJECTIONS = web.AppKey("rejections", Rejections)


def bind(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not host and socket.has_dualstack_ipv6():
        sock = socket.create_server(("", int(port)), family=socket.AF_INET6, dualstack_ipv6=True)
    else:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, int(port)), family=family)
    sock.setblocking(False)
    return sock


async def listen(app: web.Application, address: str, tls: ssl.SSLContext | None, limits: Limits) -> Listener:
    try:
        sock = bind(address)
    except OSError as err:  # e.g. the port is taken: a config error, not a traceback
        raise ConfigError(f"--web.listen-address: cannot listen on {address}: {err.strerror}") from err
    logging.getLogger("aiohttp.server").addFilter(app[REJECTIONS])
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.idle_timeout)
    await runner.setup()
    return Listener(runner, sock, tls, limits)
