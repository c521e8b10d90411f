"""Bounded HTTP GET shared by every source that polls an exposition (vLLM, dcgm-exporter).

The whole body is read to its end, within a byte bound and one deadline: a body that arrives
in many small writes is complete or an error, never silently cut. No redirect is followed (a
target never comes from an answer) and gzip is inflated with the same byte bound applied to
the inflated size, so a compression bomb costs at most `max_bytes`. The text format ends every
line with a line feed: a body whose last line has none was cut (no Content-Length and a close,
or a proxy that cut it), and its last "sample" may be a number's first digits: truncated_body.

Why not aiohttp's client (issue 22): its request and response machinery (cookies, tracing,
redirect handling, a task and a payload stream per request) was ~0.2 ms of CPU per fetch, about
a fifth of a poll, for one GET the exporter repeats on one kept-alive connection. This client
is an asyncio protocol plus the HTTP/1.1 framings an exposition arrives in: Content-Length,
chunked, or no length and a close; about half aiohttp's CPU per fetch (docs/benchmarks.md).
Why not asyncio's streams (issue 30): each read was a new bytes object copied into the reader's
buffer and out again, in pure-Python reader code; `Stream` receives into one buffer kept per
connection, and a Content-Length body is decoded straight out of it (`fetch_text`).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import ssl
import zlib
from urllib.parse import unquote, urlsplit

from ..deadline import Deadline
from .base import SourceError
from .http_stream import READ_SIZE, Stream

# We ask for plain text; an upstream may still compress, and then we inflate under the bound.
REQUEST_HEADERS = {"Accept-Encoding": "identity, gzip;q=0.5", "User-Agent": "kvcache-exporter"}
MAX_PREPARED = 256  # requests kept built per session (one per URL and header set)


class Session:
    """Kept-alive connections, one idle one per (scheme, host, port); `async with` closes them.
    Without keep_alive a connection is closed after its request (the aggregator's 1,000 targets
    would otherwise hold 1,000 idle descriptors)."""

    def __init__(self, keep_alive: bool = True) -> None:
        self.keep_alive = keep_alive
        self._idle: dict[tuple[str, str, int], Stream] = {}
        self._prepared: dict[tuple[str, ...], tuple[tuple[str, str, int], bytes]] = {}
        self._tls: ssl.SSLContext | None = None
        self.deadline = Deadline()  # fetch_text's bound: one timer across polls

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()

    async def close(self) -> None:
        idle, self._idle = self._idle, {}
        for stream in idle.values():
            stream.close()

    async def _open(self, scheme: str, host: str, port: int) -> Stream:
        tls = None
        if scheme == "https":
            tls = self._tls = self._tls or ssl.create_default_context()
        return (await asyncio.get_running_loop().create_connection(Stream, host, port, ssl=tls))[1]

    async def get(self, url: str, headers: dict[str, str], max_bytes: int) -> bytes:
        """The whole body of a 200 answer to a GET of `url`, or SourceError."""
        body, lead = await self._get(url, headers, max_bytes)
        return bytes(body[lead:])

    async def _get(self, url: str, headers: dict[str, str], max_bytes: int) -> tuple[bytes | memoryview, int]:
        """(data, lead): the body is data[lead:]; lead 1 when data starts with a line feed before the
        body (a Content-Length body is a view into the connection's buffer, good until its next read,
        with the line feed that ends the header)."""
        asked = (url, *headers.items())  # a poll repeats its request: built once, not every poll
        prepared = self._prepared.get(asked)
        if prepared is None:
            if len(self._prepared) >= MAX_PREPARED:  # a token that rotates makes new ones
                self._prepared.clear()
            prepared = self._prepared[asked] = _request(url, headers)
        key, request = prepared
        connection = self._idle.pop(key, None)
        if connection is not None and connection.at_eof():  # the upstream closed it while idle
            connection.close()
            connection = None
        if connection is not None:
            try:
                return await self._exchange(connection, key, request, url, max_bytes)
            except (ConnectionError, _Unanswered):
                pass  # closed between polls, before we saw it: once more on a new connection
        connection = await self._open(*key)
        try:
            return await self._exchange(connection, key, request, url, max_bytes)
        except _Unanswered as err:
            raise SourceError("connection", f"{url} closed the connection without answering") from err

    async def _exchange(
        self, stream: Stream, key, request: bytes, url: str, max_bytes: int
    ) -> tuple[bytes | memoryview, int]:
        try:
            stream.write(request)
            try:
                head = await stream.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as err:
                if not err.partial:
                    raise _Unanswered from err
                raise SourceError("connection", f"{url} closed the connection mid-header") from err
            except asyncio.LimitOverrunError as err:
                raise SourceError("connection", f"{url} sent a header over {READ_SIZE} bytes") from err
            status, fields, keep = _head(head, url)
            framed = "content-length" in fields or "chunked" in fields.get("transfer-encoding", "").lower()
            keep = keep and framed  # with neither, the body ends where the connection does
            if status != 200:
                if keep and self.keep_alive and stream.skip(fields.get("content-length", "")):
                    self._idle[key] = stream  # its body came whole with it: the connection serves on
                raise HttpStatusError(url, status)
            body = await _body(stream, fields, url, max_bytes)
        except BaseException:
            if self._idle.get(key) is not stream:
                stream.close()
            raise
        if keep and self.keep_alive:
            self._idle[key] = stream
        else:
            stream.close()
        return body


def _request(url: str, headers: dict[str, str]) -> tuple[tuple[str, str, int], bytes]:
    """The connection key (scheme, host, port) and the bytes of a GET of `url`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SourceError("connection", f"{url} is not an http(s) URL")
    key = (parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"GET {target} HTTP/1.1", f"Host: {parts.netloc.rpartition('@')[2]}"]
    if parts.username is not None and "Authorization" not in headers:  # as aiohttp did: the URL's user
        user = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
        headers = {**headers, "Authorization": "Basic " + base64.b64encode(user).decode()}
    lines += [f"{name}: {value}" for name, value in {**REQUEST_HEADERS, **headers}.items()]
    return key, ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpStatusError(SourceError):
    """An answer other than 200: `status` tells a missing route (404) from a failing server."""

    def __init__(self, url: str, status: int):
        super().__init__("http_status", f"{url} answered HTTP {status}")
        self.status = status


class _Unanswered(Exception):
    """The connection ended before a byte of the answer: on a kept-alive one, the upstream closed it."""


def new_session(keep_alive: bool = True) -> Session:
    return Session(keep_alive)


async def fetch_text(
    session: Session,
    url: str,
    *,
    timeout: float,
    max_bytes: int,
    headers: dict[str, str] | None = None,
    lead: bool = False,
) -> str:
    """GET `url` and return its whole body ("\n" + the body with `lead`: what a parse that looks
    for "\n" + a name reads, without a copy to make it); raise SourceError(reason) on anything
    but a complete 200."""
    try:
        async with session.deadline.within(timeout):
            data, has_lead = await session._get(url, headers or {}, max_bytes)
    except TimeoutError as err:
        raise SourceError("timeout", f"{url} did not send its whole answer within {timeout:g}s") from err
    except OSError as err:  # refused, reset, unreachable, TLS; or no descriptor left for it here
        reason = "fd_exhausted" if err.errno in (errno.EMFILE, errno.ENFILE) else "connection"
        raise SourceError(reason, f"{url}: {err}") from err
    if len(data) > has_lead and data[-1] != 10:  # 10: a line feed
        end = bytes(data[max(has_lead, len(data) - 24) :])
        raise SourceError("truncated_body", f"{url} body ends mid-line: {end!r} has no line feed")
    try:
        text = str(data[0 if lead else has_lead :], "utf-8")
    except UnicodeDecodeError as err:
        raise SourceError("parse_error", f"{url} body is not UTF-8") from err
    finally:
        if isinstance(data, memoryview):
            data.release()
    return "\n" + text if lead and not has_lead else text


# Header lines read before -> (name in lower case, value): an upstream's answers repeat most of theirs.
_LINES: dict[str, tuple[str, str]] = {}
MAX_LINES = 256


def _head(head: bytes, url: str) -> tuple[int, dict[str, str], bool]:
    """(status, header fields by lower-case name, whether the connection stays open after the body)."""
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    code = rest[:3]
    if not (version.startswith("HTTP/1.") and code.isdigit()):
        raise SourceError("connection", f"{url} answered {status_line[:60]!r}, not HTTP/1.x")
    fields: dict[str, str] = {}
    for line in lines:
        known = _LINES.get(line)
        if known is None:
            name, colon, value = line.partition(":")
            if not colon:
                raise SourceError("connection", f"{url} sent a malformed header line {line[:60]!r}")
            if len(_LINES) >= MAX_LINES:
                _LINES.clear()
            known = _LINES[line] = (name.strip().lower(), value.strip())
        name, value = known
        fields[name] = f"{fields[name]}, {value}" if name in fields else value
    connection = fields.get("connection", "").lower()
    keep = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
    return int(code), fields, keep


async def _body(
    reader: Stream, fields: dict[str, str], url: str, max_bytes: int
) -> tuple[bytes | memoryview, int]:
    encoding = fields.get("content-encoding", "identity").strip().lower()
    if encoding not in ("identity", "", "gzip"):
        raise SourceError("parse_error", f"{url} sent unsupported Content-Encoding {encoding}")
    chunked = "chunked" in fields.get("transfer-encoding", "").lower()
    length = fields.get("content-length")
    if encoding != "gzip" and not chunked and length is not None and length.isdigit():
        # the usual answer: one read of the whole body, no sink
        left = int(length)
        if left > max_bytes:
            raise SourceError("body_too_large", f"{url} body is {left} bytes")
        try:
            return await reader.body(left)
        except asyncio.IncompleteReadError as err:
            missing = left - len(err.partial)
            raise SourceError(
                "truncated_body", f"{url} closed the connection {missing} bytes before its end"
            ) from err
    sink = _Sink(url, max_bytes, zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None)
    if chunked:
        await _chunked(reader, sink, url)
        return sink.end(), 0
    if length is None:  # no length: the body ends where the connection does
        while chunk := await reader.read(READ_SIZE):
            sink.add(chunk)
        return sink.end(), 0
    if not length.isdigit():
        raise SourceError("connection", f"{url} sent Content-Length {length[:40]!r}")
    left = int(length)
    while left:
        chunk = await reader.read(min(left, READ_SIZE))
        if not chunk:
            raise SourceError("truncated_body", f"{url} closed the connection {left} bytes before its end")
        left -= len(chunk)
        sink.add(chunk)
    return sink.end(), 0


async def _chunked(reader: Stream, sink: _Sink, url: str) -> None:
    try:
        while True:
            size_line = await reader.readuntil(b"\r\n")
            try:
                size = int(size_line.split(b";", 1)[0].strip(), 16)
            except ValueError as err:
                raise SourceError("connection", f"{url} sent a malformed chunk size") from err
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":  # trailer fields, ignored
                    pass
                return
            while size:
                chunk = await reader.read(min(size, READ_SIZE))
                if not chunk:
                    raise asyncio.IncompleteReadError(b"", size)
                size -= len(chunk)
                sink.add(chunk)
            if await reader.readexactly(2) != b"\r\n":
                raise SourceError("connection", f"{url} sent a chunk longer than its size")
    except asyncio.IncompleteReadError as err:
        raise SourceError("truncated_body", f"{url} closed the connection mid-body") from err
    except asyncio.LimitOverrunError as err:
        raise SourceError("connection", f"{url} sent a chunk size line over {READ_SIZE} bytes") from err


class _Sink:
    """The body's bytes, inflated when gzip, never more than `max_bytes` of them."""

    def __init__(self, url: str, max_bytes: int, inflate: zlib._Decompress | None):
        self.url, self.max_bytes, self.inflate = url, max_bytes, inflate
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, chunk: bytes) -> None:
        if self.inflate is not None:
            try:
                # max_length bounds the inflated bytes of this step; what is left stays in the object.
                chunk = self.inflate.decompress(chunk, self.max_bytes + 1 - self.size)
            except zlib.error as err:
                raise SourceError("parse_error", f"{self.url} sent a corrupt gzip body: {err}") from err
            if self.inflate.unconsumed_tail:
                raise SourceError("body_too_large", f"{self.url} body inflates beyond {self.max_bytes} bytes")
        self.size += len(chunk)
        if self.size > self.max_bytes:
            raise SourceError("body_too_large", f"{self.url} body exceeds {self.max_bytes} bytes")
        self.parts.append(chunk)

    def end(self) -> bytes:
        if self.inflate is not None and not self.inflate.eof:
            raise SourceError("truncated_body", f"{self.url} gzip body ended before its end marker")
        return b"".join(self.parts)
