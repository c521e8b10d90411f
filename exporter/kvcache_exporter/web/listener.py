"""Our own accept loop, so connections are bounded where they cost memory: at the socket.

A half-open TLS connection held ~300 KiB; 3,000 of them took 951 MiB. Here at most
`max_connections` are open, TLS handshakes included, a handshake gets `handshake_timeout` and an
idle connection `idle_timeout` (aiohttp's keep-alive timer, which also runs before the first
request). A full house does not lock scrapers out: a new connection takes the slot of an idle one
(`victim`), so a client holding idle connections only ever holds them until someone else comes.
A connection is refused only while every open one has a request in flight. Refused and evicted
connections and malformed requests are counted in kvcache_exporter_http_rejected_total{reason},
and logged at most once a minute.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong

from .. import catalog as c
from ..config import ConfigError
from ..samples import Sample

log = logging.getLogger("kvcache_exporter")
REASONS = (
    "too_many_connections",
    "idle_evicted",
    "tls_handshake",
    "header_too_large",
    "bad_request",
    "auth_busy",
)


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 256
    idle_timeout: float = 60.0
    handshake_timeout: float = 10.0


@dataclass(eq=False)
class Connection:
    address: str
    opened: float
    close: Callable[[], None]
    busy: int = 0  # requests in flight
    proven: bool = False  # has made an authorized request
    spoke: bool = False  # has sent a byte (a ClientHello, a request line)
    established: bool = False  # TLS handshake done (at once without TLS)
    last_active: float = field(init=False)  # opened, handshake done, bytes received, request done

    def __post_init__(self):
        self.last_active = self.opened


def victim(connections: Iterable[Connection]) -> Connection | None:
    """The connection a new one replaces when every slot is taken; None while all are busy.

    First one that never made an authorized request, taken from the address holding most of those:
    a flood from one address evicts itself before anyone else. Within it, the one quiet longest
    (since it connected, finished its handshake or sent a byte), a handshake under way (a
    ClientHello came) last: a scraper speaks at once and is active from its handshake to its
    request, so a flood that reconnects as fast as it is evicted must turn over every other slot to
    reach it. Then the idle connection quiet longest, so a scraper's kept-alive connection goes
    last; Prometheus reconnects if it goes.
    """
    idle = [c for c in connections if not c.busy]
    unproven = [c for c in idle if not c.proven]
    if unproven:
        held = Counter(c.address for c in unproven)
        return min(unproven, key=lambda c: (-held[c.address], c.spoke and not c.established, c.last_active))
    return min(idle, key=lambda c: c.last_active, default=None)


class Connections:
    """The open connections, by the transport aiohttp's requests carry (request.transport)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.by_transport: dict[object, Connection] = {}
        self.all: set[Connection] = set()

    def find(self, transport: object) -> Connection | None:
        return self.by_transport.get(transport)


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
        self, runner: web.AppRunner, sock: socket.socket, tls: ssl.SSLContext | None, limits: ConnectionLimits
    ):
        self.runner, self.sock, self.tls, self.limits = runner, sock, tls, limits
        self.rejections: Rejections = runner.app[REJECTIONS]
        self.connections: Connections = runner.app[CONNECTIONS]
        self.tasks: set[asyncio.Task] = set()
        self.accepting = asyncio.get_running_loop().create_task(self._accept())

    @property
    def open(self) -> int:
        return len(self.connections.all)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, peer = await loop.sock_accept(self.sock)
            except OSError as err:  # e.g. out of file descriptors: keep accepting once some close
                self.rejections.count("too_many_connections", repr(err))
                await asyncio.sleep(0.1)
                continue
            if self.open >= self.limits.max_connections:
                old = victim(self.connections.all)
                if old is None:
                    conn.close()
                    self.rejections.count("too_many_connections")
                    continue
                self._drop(old)
                self.rejections.count("idle_evicted", old.address)
            this = Connection(str(peer[0]), self.connections.clock(), conn.close)
            task = loop.create_task(self._serve(conn, this))
            this.close = functools.partial(_close_unstarted, task, conn)
            self.connections.all.add(this)
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _drop(self, connection: Connection) -> None:
        self.connections.all.discard(connection)  # its slot is free now, whatever closing takes
        connection.close()

    async def _serve(self, conn: socket.socket, this: Connection) -> None:
        loop = asyncio.get_running_loop()
        this.close = asyncio.current_task().cancel  # from here on, asyncio closes what it opened
        closed, transport = loop.create_future(), None
        try:
            if not await self._first_bytes(conn):
                conn.close()
                if self.tls:
                    self.rejections.count("tls_handshake", "no ClientHello")
                return
            this.spoke, this.last_active = True, self.connections.clock()
            transport, _ = await loop.connect_accepted_socket(
                lambda: _Tracked(self.runner.server(), closed, this, self.connections.clock),
                conn,
                ssl=self.tls,
                ssl_handshake_timeout=self.limits.handshake_timeout if self.tls else None,
            )
            self.connections.by_transport[transport] = this
            this.close, this.established = transport.abort, True
            this.last_active = self.connections.clock()
            await closed
        except (OSError, ssl.SSLError, TimeoutError, ConnectionError) as err:
            conn.close()
            self.rejections.count("tls_handshake", repr(err))
        finally:
            self.connections.all.discard(this)
            self.connections.by_transport.pop(transport, None)

    async def _first_bytes(self, conn: socket.socket) -> bool:
        """Waits for the client's first byte (or its hang-up): False if none came in time."""
        loop, fd = asyncio.get_running_loop(), conn.fileno()
        ready = loop.create_future()
        loop.add_reader(fd, lambda: ready.done() or ready.set_result(True))
        try:
            timeout = self.limits.handshake_timeout if self.tls else self.limits.idle_timeout
            return await asyncio.wait_for(ready, timeout)
        except TimeoutError:
            return False
        except asyncio.CancelledError:  # evicted: asyncio has not taken the socket over yet
            loop.remove_reader(fd)
            conn.close()
            raise
        finally:
            loop.remove_reader(fd)

    async def close(self) -> None:
        self.accepting.cancel()
        self.sock.close()
        logging.getLogger("aiohttp.server").removeFilter(self.rejections)
        for task in list(self.tasks):  # first: one still waiting for its first byte has no server after
            task.cancel()
        await self.runner.cleanup()  # closes the open connections


def _close_unstarted(task: asyncio.Task, conn: socket.socket) -> None:
    task.cancel()
    conn.close()  # a task cancelled before its first step never runs its body to close it


class _Tracked(asyncio.Protocol):
    """aiohttp's protocol for one connection, telling the listener when bytes come and when it closes."""

    def __init__(self, inner: asyncio.Protocol, closed: asyncio.Future, this: Connection, clock):
        self.inner, self.closed, self.this, self.clock = inner, closed, this, clock

    def connection_made(self, transport):
        self.inner.connection_made(transport)

    def data_received(self, data):
        self.this.last_active = self.clock()
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
CONNECTIONS = web.AppKey("connections", Connections)


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


async def listen(
    app: web.Application, address: str, tls: ssl.SSLContext | None, limits: ConnectionLimits
) -> Listener:
    try:
        sock = bind(address)
    except OSError as err:  # e.g. the port is taken: a config error, not a traceback
        raise ConfigError(f"--web.listen-address: cannot listen on {address}: {err.strerror}") from err
    logging.getLogger("aiohttp.server").addFilter(app[REJECTIONS])
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=limits.idle_timeout)
    await runner.setup()
    return Listener(runner, sock, tls, limits)
