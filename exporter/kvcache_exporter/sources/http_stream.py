"""One HTTP connection's bytes, for sources/http.py: what asyncio's StreamReader did, in one buffer.

Why (issue 30): StreamReader made a bytes object per read and copied it into its buffer and out
again, in pure-Python reader code; here each read lands in one buffer kept for the connection's
life, and a Content-Length body is handed out as a view into it (`Stream.body`).
"""

from __future__ import annotations

import asyncio

READ_SIZE = 1 << 16


class Stream(asyncio.BufferedProtocol):
    """One connection: what it received, in one buffer kept for its life (each read lands in it,
    no bytes object made per read), read as asyncio's StreamReader reads, with its errors.
    At most READ_SIZE unread bytes are asked for, or what a Content-Length body needs (`body`):
    past that, reading pauses until they are read."""

    def __init__(self) -> None:
        self.buffer = bytearray(READ_SIZE)  # grows to the largest answer; vLLM's is ~60 KiB
        self.start = self.end = 0  # the unread bytes are buffer[start:end]
        self.wanted = READ_SIZE
        self.transport: asyncio.Transport | None = None
        self.eof = False
        self.error: BaseException | None = None
        self.paused = False
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        unread = self.end - self.start
        if not unread:
            self.start = self.end = 0
        if len(self.buffer) - self.end < READ_SIZE // 4:
            # A new buffer, never a resized one: a body handed out as a view may still hold the old.
            size = max(len(self.buffer), 2 * (unread + READ_SIZE // 4))
            buffer = bytearray(size)
            buffer[:unread] = memoryview(self.buffer)[self.start : self.end]
            self.buffer, self.start, self.end = buffer, 0, unread
        return memoryview(self.buffer)[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.end += nbytes
        if self.end - self.start >= self.wanted and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # then the transport closes

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.eof = True
        else:
            self.error = exc  # what every read raises from now on, as StreamReader did
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def write(self, data: bytes) -> None:
        if self.transport is not None:  # a lost connection drops it: the read then says why
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def at_eof(self) -> bool:
        return self.eof and self.start == self.end

    def _take(self, n: int) -> bytes:
        out = bytes(memoryview(self.buffer)[self.start : self.start + n])
        self._consume(n)
        return out

    def _consume(self, n: int) -> None:
        self.start += n
        if self.paused and self.end - self.start < self.wanted and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    async def readuntil(self, separator: bytes) -> bytes:
        """The bytes up to and with `separator`; LimitOverrunError past READ_SIZE without it,
        IncompleteReadError (with what came) when the connection ends first."""
        if self.error is not None:
            raise self.error
        searched = 0  # bytes past `start` searched already: get_buffer may move them
        while True:
            if self.end - self.start - searched >= len(separator):
                found = self.buffer.find(separator, self.start + searched, self.end)
                if found >= 0:
                    if found - self.start > READ_SIZE:
                        raise asyncio.LimitOverrunError("separator is found, but chunk is too long", 0)
                    return self._take(found + len(separator) - self.start)
                searched = self.end - self.start + 1 - len(separator)
                if searched > READ_SIZE:
                    raise asyncio.LimitOverrunError("separator is not found, and chunk exceed the limit", 0)
            if self.eof:
                raise asyncio.IncompleteReadError(self._take(self.end - self.start), None)
            await self._wait()
            if self.error is not None:
                raise self.error

    def skip(self, length: str) -> bool:
        """Drop a body of `length` (a Content-Length) bytes if it is all here already (a route's 404
        answer): True when the connection is then at the next answer."""
        if not length.isdigit() or self.error is not None or self.end - self.start < int(length):
            return False
        self._consume(int(length))
        return True

    async def readexactly(self, n: int) -> bytes:
        await self._fill(n)
        return self._take(n)

    async def body(self, n: int) -> tuple[memoryview, int]:
        """The next `n` bytes as a view into the buffer, (data, 1) with the byte before them when it
        is a line feed (the header's last), else (data, 0): good until the next read."""
        await self._fill(n)
        start = self.start
        self._consume(n)
        lead = int(start > 0 and self.buffer[start - 1] == 10)
        return memoryview(self.buffer)[start - lead : start + n], lead

    async def _fill(self, n: int) -> None:
        if self.error is not None:
            raise self.error
        self.wanted = max(n, READ_SIZE)
        try:
            while self.end - self.start < n:
                if self.eof:
                    raise asyncio.IncompleteReadError(self._take(self.end - self.start), n)
                await self._wait()
                if self.error is not None:
                    raise self.error
        finally:
            self.wanted = READ_SIZE

    async def read(self, n: int) -> bytes:
        """At most `n` bytes, as soon as there are any; b"" once the connection ended."""
        if self.error is not None:
            raise self.error
        while self.start == self.end and not self.eof:
            await self._wait()
            if self.error is not None:
                raise self.error
        return self._take(min(n, self.end - self.start))
