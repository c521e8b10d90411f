"""Helpers for the dashboard tests: the committed JSON, its queries, and a real Prometheus.

Prometheus is Debian's `prometheus` binary, started on 127.0.0.1 with an ephemeral port and a
temp dir; a missing binary fails the tests (it never skips).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JSON_DIR = ROOT / "dashboards" / "json"
UIDS = ("kvcache-overview", "kvcache-cache", "kvcache-gpu-cost")
RATE_INTERVAL = "15s"  # what $__rate_interval becomes: 4 x the tests' 1 s scrape interval, and more


def boards() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(JSON_DIR.glob("*.json"))}


def panels(board: dict) -> Iterator[dict]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])


def substitute(expr: str, board: dict) -> str:
    """The query as Grafana sends it with "All" selected and the text boxes at their defaults."""
    for var in board["templating"]["list"]:
        value = var["query"] if var["type"] == "textbox" else ".*"
        expr = re.sub(rf"\$(\{{{var['name']}\}}|{var['name']}\b)", value, expr)
    return expr.replace("$__rate_interval", RATE_INTERVAL)


def panel_queries(board: dict) -> Iterator[tuple[str, str]]:
    """(panel title, substituted expr) for every panel target."""
    for panel in panels(board):
        for target in panel.get("targets", []):
            yield panel["title"], substitute(target["expr"], board)


def variable_queries(board: dict) -> Iterator[tuple[str, str]]:
    """(variable name, the selector inside label_values(...)) for every query variable."""
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.*), *\w+\)", var["query"])
            assert match, f"{var['name']}: unexpected variable query {var['query']!r}"
            yield var["name"], substitute(match.group(1), board)


def all_queries() -> list[tuple[str, str, str]]:
    out = []
    for uid, board in boards().items():
        out += [(uid, title, expr) for title, expr in panel_queries(board)]
        out += [(uid, f"${name}", expr) for name, expr in variable_queries(board)]
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def binary(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if not found:
        pytest.fail(
            f"{name} not found: install it (Debian: apt-get install -y prometheus) / pip install -e ."
        )
    return found


def http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def wait_until(check, what: str, timeout: float = 30.0, procs: tuple[subprocess.Popen, ...] = ()) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"{what}: {proc.args[0]} exited with {proc.returncode}")
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.3)
    pytest.fail(f"timed out waiting for {what}")


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        return json.loads(body) | {"http_status": status}


@contextmanager
def prometheus(tmp: Path, config: str) -> Iterator[Prometheus]:
    (tmp / "prometheus.yml").write_text(config)
    port = free_port()
    args = [
        binary("prometheus"),
        f"--config.file={tmp / 'prometheus.yml'}",
        f"--storage.tsdb.path={tmp / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    with process(args, tmp / "prometheus.log") as proc:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_get(f"{url}/-/ready")[0] == 200, "prometheus ready", procs=(proc,))
        yield Prometheus(url)
