"""`make bench`, our endpoint under hostile clients (issue 14 item 5): `serve` over TLS with basic
auth against a cost-12 bcrypt hash, on loopback. Each figure beside its baseline from the same run:
a scrape during 40 wrong-password clients beside a quiet one; a wrong password for an unknown
user beside one for a known user; RSS holding 3,000 half-open TLS connections beside idle.
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
    return [
        ("endpoint: scrape during 40 wrong-password clients (cost-12 bcrypt)",
         f"{during:.0f} ms (quiet: {quiet:.0f} ms; the 40 got {answers.count(401)} x 401, "
         f"{answers.count(429)} x 429)"),
        ("endpoint: wrong password, unknown user", f"{unknown:.0f} ms (known user: {known:.0f} ms)"),
        ("endpoint: RSS holding 3,000 half-open TLS connections",
         f"{holding:.0f} MiB (idle: {idle:.0f} MiB; at most 256 open, each closed after 10 s)"),
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
            return asyncio.run(_measure(port, proc.pid))
        finally:
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    for name, value in rows():
        print(f"| {name} | {value} |")
