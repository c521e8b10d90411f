"""Our endpoint under hostile clients (issue 14 item 5), over real loopback sockets: password floods,
username probing, idle and half-open TLS connections, connection floods, oversized headers."""

from __future__ import annotations

import asyncio
import base64
import logging
import subprocess

import aiohttp
import bcrypt
import pytest

from kvcache_exporter.exposition import registry_for
from kvcache_exporter.web.app import make_app
from kvcache_exporter.web.auth import Authenticator
from kvcache_exporter.web.config import load_web_config
from kvcache_exporter.web.listener import Limits, listen


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def serve(limits=None, users=None, authenticator=None, tls=None):
    app = make_app(
        registry_for(lambda: []), telemetry_path="/metrics", ready=lambda: True,
        users=users or {}, authenticator=authenticator,
    )  # fmt: skip
    listener = await listen(app, "127.0.0.1:0", tls, limits or Limits())
    return listener, listener.sock.getsockname()[1]


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(), seconds) == b""
    except TimeoutError:
        return False
    except ConnectionError:
        return True


async def metrics_text(port: int) -> tuple[int, str]:
    url = f"http://127.0.0.1:{port}/metrics"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.text()


def rejected(body: str, reason: str) -> float:
    line = f'kvcache_exporter_http_rejected_total{{reason="{reason}"}} '
    return float(next(x for x in body.splitlines() if x.startswith(line)).split()[-1])


def test_a_scrape_is_answered_while_wrong_passwords_flood_a_cost_12_hash():
    async def main():
        users = {"prom": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=12))}
        listener, port = await serve(users=users)
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as session:

            async def get(password):
                async with session.get(url, headers=basic("prom", password)) as response:
                    return response.status

            assert await get("right") == 200  # remembered from now on
            flood = [asyncio.create_task(get(f"wrong{i}")) for i in range(40)]
            await asyncio.sleep(0.05)
            assert await get("right") == 200
            pending = sum(not task.done() for task in flood)
            statuses = await asyncio.gather(*flood)
        await listener.close()
        return pending, statuses

    pending, statuses = asyncio.run(main())
    assert pending > 0  # the good scrape did not wait for the bcrypt checks queued before it
    assert set(statuses) <= {401, 429} and 401 in statuses and 429 in statuses  # queue bounded


def test_unknown_and_known_users_both_pay_an_equal_cost_bcrypt():
    calls = []

    def verify(password, hashed):
        calls.append(hashed[:7])
        return bcrypt.checkpw(password, hashed)

    users = {"alice": bcrypt.hashpw(b"secret", bcrypt.gensalt(rounds=6))}
    checker = Authenticator(users, verify=verify)

    async def main():
        return [await checker.check(basic(user, "guess")["Authorization"]) for user in ("alice", "mallory")]

    assert asyncio.run(main()) == ["unauthorized", "unauthorized"]
    assert calls == [b"$2b$06$", b"$2b$06$"]
    checker.close()


def test_an_idle_connection_is_closed_after_the_idle_timeout():
    async def main():
        listener, port = await serve(Limits(idle_timeout=0.5))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        closed = await closed_within(reader, 5)
        writer.close()
        await listener.close()
        return closed

    assert asyncio.run(main())


@pytest.fixture(scope="module")
def tls_context(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", folder / "key.pem", "-out", folder / "cert.pem", "-days", "1",
                    "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    web_config = folder / "web.yaml"
    web_config.write_text("tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n")
    return load_web_config(str(web_config)).ssl_context


def test_a_half_open_tls_connection_is_closed_after_the_handshake_timeout(tls_context):
    async def main():
        listener, port = await serve(Limits(handshake_timeout=0.5, idle_timeout=60), tls=tls_context)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # TCP only, no ClientHello
        closed = await closed_within(reader, 5)
        await asyncio.sleep(0.1)
        still_open, failed = listener.open, listener.rejections.counts["tls_handshake"]
        writer.close()
        await listener.close()
        return closed, still_open, failed

    assert asyncio.run(main()) == (True, 0, 1)


def test_connections_beyond_the_cap_are_refused_and_counted():
    async def main():
        listener, port = await serve(Limits(max_connections=3, idle_timeout=60))
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
        while listener.open < 3:
            await asyncio.sleep(0.01)
        reader, extra = await asyncio.open_connection("127.0.0.1", port)
        refused = await closed_within(reader, 5)
        extra.close()
        held.pop()[1].close()
        while listener.open >= 3:
            await asyncio.sleep(0.01)
        status, body = await metrics_text(port)
        for _, w in held:
            w.close()
        await listener.close()
        return refused, status, rejected(body, "too_many_connections")

    assert asyncio.run(main()) == (True, 200, 1.0)


def test_oversized_headers_get_400_a_count_and_one_log_line(caplog):
    async def main():
        listener, port = await serve()
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n")
            status_line = (await reader.read()).split(b"\r\n")[0]
            writer.close()
        body = (await metrics_text(port))[1]
        await listener.close()
        return status_line, rejected(body, "header_too_large")

    with caplog.at_level(logging.DEBUG):
        status_line, count = asyncio.run(main())
    assert status_line.split()[1] == b"400" and count == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["HTTP request refused"]
    assert not any(r.exc_info for r in caplog.records)


def test_an_established_scrape_connection_survives_a_half_open_tls_flood(tls_context):
    async def main():
        listener, port = await serve(Limits(max_connections=8, handshake_timeout=30), tls=tls_context)
        url = f"https://127.0.0.1:{port}/healthz"
        connector = aiohttp.TCPConnector(ssl=False, limit=1)  # one kept-alive connection, as Prometheus
        async with aiohttp.ClientSession(connector=connector) as session:
            async with session.get(url) as response:
                first = response.status
            flood = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]  # no ClientHello
            while listener.open < 8:
                await asyncio.sleep(0.01)
            async with session.get(url) as response:
                during = response.status
        for _, writer in flood:
            writer.close()
        await listener.close()
        return first, during, listener.rejections.counts["too_many_connections"]

    assert asyncio.run(main()) == (200, 200, 13)  # 8 held: ours and 7 half-open; 13 refused
