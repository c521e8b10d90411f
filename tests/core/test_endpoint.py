"""Our endpoint under hostile clients (issue 14 item 5), over real loopback sockets: password floods,
username probing, idle and half-open TLS connections, connection floods, oversized headers."""

from __future__ import annotations

import asyncio
import base64
import logging
import ssl
import subprocess
import threading

import aiohttp
import bcrypt
import pytest

from kvcache_exporter.exposition import registry_for
from kvcache_exporter.web.app import make_app
from kvcache_exporter.web.auth import Authenticator
from kvcache_exporter.web.config import load_web_config
from kvcache_exporter.web.listener import Connection, ConnectionLimits, listen, victim


def basic(user: str, password: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


async def serve(limits=None, users=None, authenticator=None, tls=None):
    app = make_app(
        registry_for(lambda: []), telemetry_path="/metrics", ready=lambda: True,
        users=users or {}, authenticator=authenticator,
    )  # fmt: skip
    listener = await listen(app, "127.0.0.1:0", tls, limits or ConnectionLimits())
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
        listener, port = await serve(ConnectionLimits(idle_timeout=0.5))
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
        listener, port = await serve(
            ConnectionLimits(handshake_timeout=0.5, idle_timeout=60), tls=tls_context
        )
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # TCP only, no ClientHello
        closed = await closed_within(reader, 5)
        await asyncio.sleep(0.1)
        still_open, failed = listener.open, listener.rejections.counts["tls_handshake"]
        writer.close()
        await listener.close()
        return closed, still_open, failed

    assert asyncio.run(main()) == (True, 0, 1)


def test_a_connection_is_refused_only_while_every_slot_has_a_request_in_flight():
    release = threading.Event()

    def verify(password, hashed):
        release.wait(10)
        return bcrypt.checkpw(password, hashed)

    users = {"prom": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=4))}

    async def main():
        checker = Authenticator(users, verify=verify)
        listener, port = await serve(ConnectionLimits(max_connections=3, idle_timeout=60), users, checker)
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:

            async def get():
                async with session.get(url, headers=basic("prom", "right")) as response:
                    return response.status

            busy = [asyncio.create_task(get()) for _ in range(3)]
            while checker.pending.total() < 3:
                await asyncio.sleep(0.01)
            reader, extra = await asyncio.open_connection("127.0.0.1", port)
            refused = await closed_within(reader, 5)
            extra.close()
            release.set()
            statuses = await asyncio.gather(*busy)
            async with session.get(url, headers=basic("prom", "right")) as response:
                body = await response.text()
        await listener.close()
        return refused, statuses, rejected(body, "too_many_connections")

    assert asyncio.run(main()) == (True, [200, 200, 200], 1.0)


def idle(address: str, opened: float, *, busy=0, proven=False, last=0.0, spoke=True, established=True):
    connection = Connection(address, opened, lambda: None, busy, proven, spoke, established)
    connection.last_active = last or opened
    return connection


def test_the_victim_is_an_unproven_idle_connection_of_the_address_holding_most_of_them():
    a_old, a_new, b_oldest = idle("a", 2.0), idle("a", 3.0), idle("b", 1.0)
    scraper = idle("b", 0.5, proven=True, last=9.0)
    assert victim([scraper, b_oldest, a_new, a_old]) is a_old  # "a" holds 2 unproven, "b" 1
    assert victim([scraper, b_oldest, idle("a", 0.1, busy=1)]) is b_oldest  # in flight: never
    spoke, handshaking = idle("a", 0.1, last=4.0), idle("a", 0.2, established=False)
    assert victim([spoke, a_new, handshaking]) is a_new  # quiet longest, handshakes last
    newborn, silent = idle("a", 5.0, spoke=False, established=False), idle("a", 1.0, spoke=False)
    assert victim([spoke, a_new, handshaking, newborn]) is a_new  # the newborn has had no time yet
    assert victim([spoke, a_new, handshaking, silent]) is silent
    quiet = idle("c", 0.1, proven=True, last=5.0)
    assert victim([scraper, quiet]) is quiet  # all proven: the longest idle goes
    assert victim([idle("a", 1.0, busy=1), idle("b", 2.0, busy=2, proven=True)]) is None


async def scrape(port: int, tls: ssl.SSLContext | None, deadline: float = 20.0) -> int:
    """One scrape on a fresh connection, as a Prometheus that just started: the status, 0 if none."""
    try:
        async with asyncio.timeout(deadline):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=tls)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            line = await reader.readline()
            writer.close()
            return int(line.split()[1]) if line else 0
    except (OSError, TimeoutError, ssl.SSLError):
        return 0


def test_a_correct_password_is_never_refused_while_wrong_ones_flood_once_its_cache_expired():
    users = {"prom": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=10))}

    async def main():
        checker = Authenticator(users, success_ttl=0.0)  # every scrape is checked with bcrypt again
        listener, port = await serve(users=users, authenticator=checker)
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as session:

            async def get(password):
                async with session.get(url, headers=basic("prom", password)) as response:
                    return response.status

            first = await get("right")
            stop, flooded = asyncio.Event(), []

            async def flood(i):
                while not stop.is_set():
                    flooded.append(await get(f"wrong{i}"))

            flooders = [asyncio.create_task(flood(i)) for i in range(40)]
            correct = [await get("right") for _ in range(30)]
            stop.set()
            await asyncio.gather(*flooders)
        await listener.close()
        return first, correct, flooded

    first, correct, flooded = asyncio.run(main())
    assert first == 200 and correct.count(200) == 30
    assert 429 in flooded and 401 in flooded  # the flood did fill the queue of unknown credentials


def test_one_address_gets_a_share_of_the_password_checks_not_all_of_them():
    release = threading.Event()
    users = {"prom": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=4))}
    checker = Authenticator(users, max_pending=16, max_pending_per_address=4,
                            verify=lambda p, h: release.wait(10) and bcrypt.checkpw(p, h))  # fmt: skip

    async def main():
        wrong, right = basic("prom", "wrong")["Authorization"], basic("prom", "right")["Authorization"]
        flood = [asyncio.create_task(checker.check(wrong, "10.0.0.2")) for _ in range(4)]
        while checker.pending.total() < 4:
            await asyncio.sleep(0.01)
        fifth = await checker.check(wrong, "10.0.0.2")
        newcomer = asyncio.create_task(checker.check(right, "10.0.0.1"))
        await asyncio.sleep(0.05)
        release.set()
        return fifth, await newcomer, await asyncio.gather(*flood)

    assert asyncio.run(main()) == ("busy", "ok", ["unauthorized"] * 4)
    checker.close()


async def hold(port: int, n: int, tls: ssl.SSLContext | None, source: str, stop: asyncio.Event) -> None:
    """n connections that never send a request, each reopened as soon as the server closes it."""

    async def one():
        while not stop.is_set():
            try:
                reader, writer = await asyncio.open_connection(
                    "127.0.0.1", port, ssl=tls, local_addr=(source, 0)
                )
            except (OSError, ssl.SSLError):
                await asyncio.sleep(0.01)
                continue
            stop_waiting = asyncio.create_task(stop.wait())
            await asyncio.wait(
                [asyncio.create_task(reader.read()), stop_waiting], return_when="FIRST_COMPLETED"
            )
            writer.close()

    await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)


def client_tls() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    return context


@pytest.mark.parametrize(
    "scheme, hostile_handshake, source",
    [
        ("http", False, "127.0.0.1"),  # the scrapers' own address: told apart only by behaviour
        ("https", False, "127.0.0.1"),  # TCP only, no ClientHello
        ("https", True, "127.0.0.1"),  # handshake done, no request
        ("http", False, "127.0.0.2"),  # another address
        ("https", False, "127.0.0.2"),
    ],
)
def test_fresh_scrapes_get_in_while_a_client_holds_idle_connections(
    scheme, hostile_handshake, source, tls_context
):
    async def main():
        tls = tls_context if scheme == "https" else None
        limits = ConnectionLimits(max_connections=64, idle_timeout=60, handshake_timeout=60)
        listener, port = await serve(limits, tls=tls)
        stop = asyncio.Event()
        hostile = asyncio.create_task(
            hold(port, 80, client_tls() if hostile_handshake else None, source, stop)
        )
        while listener.open < 64:
            await asyncio.sleep(0.01)
        statuses = [await scrape(port, client_tls() if tls else None) for _ in range(30)]
        evicted = listener.rejections.counts["idle_evicted"]
        stop.set()
        await hostile
        await listener.close()
        return statuses, evicted

    statuses, evicted = asyncio.run(main())
    assert statuses.count(200) == 30
    assert evicted >= 30  # the hostile client held every slot: each scrape took one of its


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
        listener, port = await serve(
            ConnectionLimits(max_connections=8, handshake_timeout=30), tls=tls_context
        )
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
        return first, during, listener.rejections.counts["idle_evicted"]

    assert asyncio.run(main()) == (200, 200, 13)  # 8 held: ours and 7 half-open; 13 evicted
