"""A real loopback HTTP server that frames each answer as the test says, written byte by byte so
that every framing a server or a proxy uses is possible: a Content-Length, chunked, gzip, or no
length at all and the connection closed after the body (HTTP/1.0 style)."""

from __future__ import annotations

import asyncio
import gzip

FRAMINGS = ("length", "chunked", "gzip", "close")


class FramingServer:
    def __init__(self, body: bytes = b"", framing: str = "length", chunk: int = 1400):
        self.body, self.framing, self.chunk = body, framing, chunk
        self.server: asyncio.Server | None = None

    async def __aenter__(self) -> FramingServer:
        self.server = await asyncio.start_server(self._answer, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *_) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/metrics"

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            head = "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\nConnection: close\r\n"
            body = gzip.compress(self.body) if self.framing == "gzip" else self.body
            if self.framing in ("length", "gzip"):
                head += f"Content-Length: {len(body)}\r\n"
            if self.framing == "gzip":
                head += "Content-Encoding: gzip\r\n"
            if self.framing == "chunked":
                head += "Transfer-Encoding: chunked\r\n"
            writer.write((head + "\r\n").encode())
            for start in range(0, len(body), self.chunk):
                part = body[start : start + self.chunk]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part) if self.framing == "chunked" else part)
                await writer.drain()
            if self.framing == "chunked":
                writer.write(b"0\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()  # "close": the end of the connection is the end of the body
