"""Helpers for the dashboard tests: the committed JSON, its queries, and a real Prometheus.

Prometheus is Debian's `prometheus` binary, started by kvcache_exporter.tools.harness on 127.0.0.1 with an
ephemeral port and a temp dir; a missing binary fails the tests (it never skips).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvcache_exporter.tools.harness import Services, http_get

ROOT = Path(__file__).resolve().parents[2]
JSON_DIR = ROOT / "dashboards" / "json"
UIDS = ("kvcache-overview", "kvcache-cache", "kvcache-gpu-cost", "kvcache-fleet")
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


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> dict:
        status, body = http_get(f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}")
        return json.loads(body) | {"http_status": status}


@contextmanager
def prometheus(tmp: Path, config: str) -> Iterator[Prometheus]:
    with Services(tmp / "prometheus") as services:
        yield Prometheus(services.prometheus(config, "--log.level=warn").url)
