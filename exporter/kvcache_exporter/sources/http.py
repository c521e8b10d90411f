"""Bounded HTTP GET shared by the sources that poll an exposition (vLLM, dcgm-exporter)."""

from __future__ import annotations

import asyncio

import aiohttp

from .base import SourceError


async def fetch_text(
    session: aiohttp.ClientSession,
    url: str,
    *,
    timeout: float,
    max_bytes: int,
    headers: dict[str, str] | None = None,
) -> str:
    """GET `url` and return its body; raise SourceError(reason) on anything but a complete 200."""
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False
        ) as response:
            if response.status != 200:
                raise SourceError("http_status", f"{url} answered HTTP {response.status}")
            if (response.content_length or 0) > max_bytes:
                raise SourceError("body_too_large", f"{url} body is {response.content_length} bytes")
            body = await response.content.read(max_bytes + 1)
            if len(body) > max_bytes:
                raise SourceError("body_too_large", f"{url} body exceeds {max_bytes} bytes")
    except TimeoutError as err:
        raise SourceError("timeout", f"{url} did not answer within {timeout:g}s") from err
    except aiohttp.ClientError as err:
        raise SourceError("connection", f"{url}: {err}") from err
    except asyncio.CancelledError:
        raise
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SourceError("parse_error", f"{url} body is not UTF-8") from err
