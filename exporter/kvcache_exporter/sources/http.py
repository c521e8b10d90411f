"""Bounded HTTP GET shared by every source that polls an exposition (vLLM, dcgm-exporter).

The whole body is read to its end, within a byte bound and one deadline: a body that arrives
in many small writes is complete or an error, never silently cut. No redirect is followed (a
target never comes from an answer) and gzip is inflated with the same byte bound applied to
the inflated size, so a compression bomb costs at most `max_bytes`. The text format ends every
line with a line feed: a body whose last line has none was cut (no Content-Length and a close,
or a proxy that cut it), and its last "sample" may be a number's first digits: truncated_body.
"""

from __future__ import annotations

import asyncio
import zlib

import aiohttp

from .base import SourceError

# We ask for plain text; an upstream may still compress, and then we inflate under the bound.
REQUEST_HEADERS = {"Accept-Encoding": "identity, gzip;q=0.5"}


def new_session(keep_alive: bool = True) -> aiohttp.ClientSession:
    """aiohttp's own decompression has no bound on the inflated size: we do it ourselves.
    Without keep_alive a connection is closed after its request (the aggregator's 1,000 targets
    would otherwise hold 1,000 idle descriptors)."""
    connector = None if keep_alive else aiohttp.TCPConnector(force_close=True)
    return aiohttp.ClientSession(auto_decompress=False, connector=connector)


async def fetch_text(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout: float,
    max_bytes: int,
    headers: dict[str, str] | None = None,
) -> str:
    """GET `url` and return its whole body; raise SourceError(reason) on anything but a complete 200."""
    try:
        async with asyncio.timeout(timeout):
            async with session.get(
                url, headers={**REQUEST_HEADERS, **(headers or {})}, allow_redirects=False
            ) as response:
                if response.status != 200:
                    raise SourceError("http_status", f"{url} answered HTTP {response.status}")
                encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
                if encoding not in ("identity", "", "gzip"):
                    raise SourceError("parse_error", f"{url} sent unsupported Content-Encoding {encoding}")
                inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if encoding == "gzip" else None
                if inflate is None and (response.content_length or 0) > max_bytes:
                    raise SourceError("body_too_large", f"{url} body is {response.content_length} bytes")
                body = await _read_all(response, url, max_bytes, inflate)
    except TimeoutError as err:
        raise SourceError("timeout", f"{url} did not send its whole answer within {timeout:g}s") from err
    except aiohttp.ClientPayloadError as err:
        raise SourceError("truncated_body", f"{url} closed the connection mid-body: {err}") from err
    except aiohttp.ClientError as err:
        raise SourceError("connection", f"{url}: {err}") from err
    if body and not body.endswith(b"\n"):
        raise SourceError("truncated_body", f"{url} body ends mid-line: {body[-24:]!r} has no line feed")
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SourceError("parse_error", f"{url} body is not UTF-8") from err


async def _read_all(
    response: aiohttp.ClientResponse, url: str, max_bytes: int, inflate: zlib._Decompress | None
) -> bytes:
    parts: list[bytes] = []
    size = 0
    async for chunk in response.content.iter_any():
        if inflate is not None:
            try:
                # max_length bounds the inflated bytes of this step; what is left stays in the object.
                chunk = inflate.decompress(chunk, max_bytes + 1 - size)
            except zlib.error as err:
                raise SourceError("parse_error", f"{url} sent a corrupt gzip body: {err}") from err
            if inflate.unconsumed_tail:
                raise SourceError("body_too_large", f"{url} body inflates beyond {max_bytes} bytes")
        size += len(chunk)
        if size > max_bytes:
            raise SourceError("body_too_large", f"{url} body exceeds {max_bytes} bytes")
        parts.append(chunk)
    if inflate is not None and not inflate.eof:
        raise SourceError("truncated_body", f"{url} gzip body ended before its end marker")
    return b"".join(parts)
