"""`make bench`, our endpoint under hostile clients (issue 14 item 5): `serve` over TLS with basic
auth against a cost-12 bcrypt hash, on loopback. Each figure beside its baseline from the same run:
a scrape during 40 wrong-password clients beside a quiet one; a wrong password for an unknown
user beside one for a known user; RSS holding 3,000 half-open TLS connections beside idle. Issue
23: fresh-connection scrapes served while one client holds 300 idle connections and reopens each
one closed (plain HTTP and TLS), and correct scrapes served during the wrong-password flood once
the remembered success has expired (in process, the TTL set to 0 so every scrape pays bcrypt).
"""

from __future__ import annotations

import asyncio
import base64
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bcrypt

from ..exposition import registry_for
from ..web.app import make_app
from ..web.auth import Authenticator
from ..web.listener import ConnectionLimits, listen
from .harness import free_port


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _web_config(folder: Path) -> Path:
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", folder / "key.pem", "-out", folder / "cert.pem", "-days", "1",
                    "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=12)).decode()
    path = folder / "web.yaml"
    tls = "tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n"
    path.write_text(f"{tls}basic_auth_users:\n  prom: '{hashed}'\n")
    return path


class _Client:
    def __init__(self, port: int):
        self.port = port
        self.context = ssl.create_default_context()
        self.context.check_hostname, self.context.verify_mode = False, ssl.CERT_NONE

    async def get(self, user: str, password: str) -> tuple[int, float]:
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, ssl=self.context)
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
        status = int((await reader.readline()).split()[1])
        writer.close()
        return status, time.perf_counter() - start

    async def scrape(self, tls: bool) -> int:
        """A fresh connection, as a Prometheus that just started; 0 when nothing came back."""
        try:
            async with asyncio.timeout(20):
                context = self.context if tls else None
                reader, writer = await asyncio.open_connection("127.0.0.1", self.port, ssl=context)
                token = base64.b64encode(b"prom:right").decode()
                request = f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n"
                writer.write(f"{request}Connection: close\r\n\r\n".encode())
                line = await reader.readline()
                writer.close()
                return int(line.split()[1]) if line else 0
        except (OSError, TimeoutError, ssl.SSLError):
            return 0

    async def hold(self, n: int, handshake: bool, stop: asyncio.Event) -> None:
        """n connections that never send a request, each reopened as soon as it is closed."""

        async def one():
            while not stop.is_set():
                try:
                    context = self.context if handshake else None
                    reader, writer = await asyncio.open_connection("127.0.0.1", self.port, ssl=context)
                    waits = [asyncio.ensure_future(reader.read()), asyncio.ensure_future(stop.wait())]
                    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                    writer.close()
                except (OSError, ssl.SSLError):
                    await asyncio.sleep(0.01)

        await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)

    async def served_while_held(self, tls: bool, handshake: bool, n: int = 300) -> int:
        stop = asyncio.Event()
        holder = asyncio.create_task(self.hold(n, handshake, stop))
        await asyncio.sleep(3)
        served = [await self.scrape(tls) for _ in range(30)].count(200)
        stop.set()
        await holder
        return served

    async def median_ms(self, user: str, password: str, n: int = 5) -> float:
        return statistics.median([(await self.get(user, password))[1] for _ in range(n)]) * 1000


async def _measure(port: int, pid: int) -> list[tuple[str, str]]:
    client = _Client(port)
    await client.get("prom", "right")  # remembered from now on, as Prometheus's next scrapes are
    quiet = await client.median_ms("prom", "right")
    flood = [asyncio.create_task(client.get("prom", f"wrong{i}")) for i in range(40)]
    await asyncio.sleep(0.1)
    during = (await client.get("prom", "right"))[1] * 1000
    answers = [status for status, _ in await asyncio.gather(*flood)]
    known, unknown = await client.median_ms("prom", "wrong"), await client.median_ms("nobody", "wrong")
    idle = _rss_mib(pid)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3000)]  # no ClientHello
    await asyncio.sleep(2)
    holding = _rss_mib(pid)
    for sock in held:
        sock.close()
    half_open, handshaken = (
        await client.served_while_held(True, False),
        await client.served_while_held(True, True),
    )
    return [
        ("endpoint: scrape during 40 wrong-password clients (cost-12 bcrypt)",
         f"{during:.0f} ms (quiet: {quiet:.0f} ms; the 40 got {answers.count(401)} x 401, "
         f"{answers.count(429)} x 429)"),
        ("endpoint: wrong password, unknown user", f"{unknown:.0f} ms (known user: {known:.0f} ms)"),
        ("endpoint: RSS holding 3,000 half-open TLS connections",
         f"{holding:.0f} MiB (idle: {idle:.0f} MiB; at most 256 open, each closed after 10 s)"),
        ("endpoint: fresh TLS scrapes served while a client holds 300 idle connections (256 slots)",
         f"{half_open} of 30 half-open, {handshaken} of 30 handshaken (issue 23: 3 of 30)"),
    ]  # fmt: skip


async def _plain_held() -> int:
    app = make_app(registry_for(lambda: []), telemetry_path="/metrics", ready=lambda: True, users={})
    listener = await listen(app, "127.0.0.1:0", None, ConnectionLimits())
    served = await _Client(listener.sock.getsockname()[1]).served_while_held(False, False)
    await listener.close()
    return served


async def _flood_after_expiry() -> tuple[int, int, float]:
    """Correct scrapes during 40 wrong-password clients, every one checked with cost-12 bcrypt."""
    users = {"prom": bcrypt.hashpw(b"right", bcrypt.gensalt(rounds=12))}
    app = make_app(registry_for(lambda: []), telemetry_path="/metrics", ready=lambda: True, users=users,
                   authenticator=Authenticator(users, success_ttl=0.0))  # fmt: skip
    listener = await listen(app, "127.0.0.1:0", None, ConnectionLimits())
    port, stop = listener.sock.getsockname()[1], asyncio.Event()

    async def get(password: str) -> int:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        token = base64.b64encode(f"prom:{password}".encode()).decode()
        writer.write(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n\r\n".encode())
        status = int((await reader.readline()).split()[1])
        writer.close()
        return status

    async def flood(i: int) -> None:
        while not stop.is_set():
            await get(f"wrong{i}")

    await get("right")
    flooders = [asyncio.create_task(flood(i)) for i in range(40)]
    start = time.perf_counter()
    served = [await get("right") for _ in range(20)].count(200)
    took = time.perf_counter() - start
    stop.set()
    await asyncio.gather(*flooders)
    await listener.close()
    return served, 20, took


def in_process_rows() -> list[tuple[str, str]]:
    plain = asyncio.run(_plain_held())
    served, tried, took = asyncio.run(_flood_after_expiry())
    return [
        ("endpoint: fresh plain-HTTP scrapes served while a client holds 300 idle connections (256 slots)",
         f"{plain} of 30 (issue 23: 0 of 30)"),
        ("endpoint: correct scrapes during 40 wrong-password clients, remembered success expired",
         f"{served} of {tried} in {took:.1f} s, each re-checked with cost-12 bcrypt "
         "(issue 23: 11 of 158 got 429)"),
    ]  # fmt: skip


def rows() -> list[tuple[str, str]]:
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        web_config = _web_config(Path(folder))
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvcache_exporter", "serve", "--vllm.url", "http://127.0.0.1:1/metrics",
             "--gpu.source", "none", "--web.config.file", web_config,
             "--web.listen-address", f"127.0.0.1:{port}"],
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            measured = asyncio.run(_measure(port, proc.pid))
        finally:
            proc.terminate()
            proc.wait(10)
    return measured + in_process_rows()


if __name__ == "__main__":
    for name, value in rows():
        print(f"| {name} | {value} |")
