"""Where the replicas of a pool are: repeated flags, a Prometheus `file_sd` file, or DNS records.

Parsing is pure; `FileSd` and `DnsSd` re-read their source (a changed file, a periodic lookup of a
headless Service's A/AAAA records) and keep the last good answer when the read fails. The replica
label comes from here, never from the data: a file_sd group's `replica` label, else `host:port`.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import yaml

from ..sources.base import SourceError
from ..sources.engine_events import ENGINES

DEFAULT_KV_EVENTS_PORT = 5557  # vLLM's default endpoint is tcp://*:5557
MAX_FILE_SD_BYTES = 4 * 1024 * 1024
DNS_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True, order=True)
class Replica:
    name: str
    metrics_url: str
    kv_events_endpoint: str | None = None
    kv_events_named: bool = False  # by --replica or a file_sd label: wins over what vLLM says
    engine: str = "vllm"  # vllm, sglang or trtllm: whose KV events (sources/engine_events.py)


class DiscoveryError(SourceError):
    pass


def _host_port(address: str) -> tuple[str, int | None]:
    parts = urlsplit(address if "//" in address else f"//{address}")
    return parts.hostname or "", parts.port


def _endpoint_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def replica_for(
    target: str, kv_port: int | None, name: str = "", kv_endpoint: str = "", engine: str = "vllm"
) -> Replica:
    """`host:port` or a URL (`/metrics` when no path); KV events at `tcp://host:kv_port` by default."""
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: want one of {', '.join(ENGINES)}")
    url = target if "://" in target else f"http://{target}"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
        raise ValueError(f"{target!r}: want host:port or http(s)://host:port[/path]")
    if not parts.path:
        url += "/metrics"
    named = bool(kv_endpoint)
    if not kv_endpoint and kv_port:
        kv_endpoint = f"tcp://{_endpoint_host(parts.hostname)}:{kv_port}"
    return Replica(name or parts.netloc, url, kv_endpoint or None, named, engine)


def parse_flag(value: str, kv_port: int | None) -> Replica:
    """`--replica TARGET[,KV_ENDPOINT[,ENGINE]]`, e.g. `10.0.0.7:8000`, `http://a:8000/metrics,tcp://a:5557`
    or `b:30000,tcp://b:5557,sglang`."""
    target, _, rest = value.partition(",")
    kv_endpoint, _, engine = rest.partition(",")
    return replica_for(
        target.strip(), kv_port, kv_endpoint=kv_endpoint.strip(), engine=engine.strip() or "vllm"
    )


def parse_file_sd(text: str, kv_port: int | None, yaml_format: bool = False) -> list[Replica]:
    """Prometheus file_sd: a list of `{"targets": [...], "labels": {...}}`. Labels we read: `replica`
    (the replica's name; only for a group of one target), `kv_events_endpoint`, `engine` (vllm,
    sglang, trtllm), `__scheme__`, `__metrics_path__`."""
    try:
        groups = yaml.safe_load(text) if yaml_format else json.loads(text)
    except (ValueError, yaml.YAMLError) as err:
        raise DiscoveryError("parse_error", f"file_sd: {err}") from err
    if not isinstance(groups, list):
        raise DiscoveryError("parse_error", "file_sd: want a list of target groups")
    out = []
    for index, group in enumerate(groups):
        targets, labels = _group(group, index)
        for target in targets:
            scheme, path = labels.get("__scheme__", "http"), labels.get("__metrics_path__", "/metrics")
            name = labels.get("replica", "") if len(targets) == 1 else ""
            try:
                out.append(
                    replica_for(
                        f"{scheme}://{target}{path}",
                        kv_port,
                        name,
                        labels.get("kv_events_endpoint", ""),
                        labels.get("engine", "vllm"),
                    )
                )
            except ValueError as err:
                raise DiscoveryError("parse_error", f"file_sd group {index}: {err}") from err
    return out


def _group(group: object, index: int) -> tuple[list[str], dict[str, str]]:
    if not isinstance(group, dict):
        raise DiscoveryError("parse_error", f"file_sd group {index} is not a map")
    targets, labels = group.get("targets", []), group.get("labels") or {}
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise DiscoveryError("parse_error", f"file_sd group {index}: targets must be a list of strings")
    if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
        raise DiscoveryError("parse_error", f"file_sd group {index}: labels must map to strings")
    return targets, labels


def from_addresses(addresses: Iterable[str], port: int, kv_port: int | None) -> list[Replica]:
    """A headless Service's A/AAAA answers: one replica per pod IP."""
    return [replica_for(f"{_endpoint_host(a)}:{port}", kv_port) for a in sorted(set(addresses))]


def bounded(replicas: Iterable[Replica], limit: int) -> tuple[list[Replica], int]:
    """One replica per name (the first wins), sorted, at most `limit`; and how many were left out."""
    by_name: dict[str, Replica] = {}
    for replica in replicas:
        by_name.setdefault(replica.name, replica)
    ordered = sorted(by_name.values())
    return ordered[:limit], max(len(ordered) - limit, 0)


class StaticSd:
    """Replicas named on the command line (`--replica`)."""

    name = "discovery_static"

    def __init__(self, replicas: list[Replica]):
        self.last = replicas

    async def refresh(self) -> list[Replica]:
        return self.last


class FileSd:
    """A file_sd file, parsed again only when its size or modification time changes."""

    name = "discovery_file_sd"

    def __init__(self, path: str, kv_port: int | None):
        self.path, self.kv_port = path, kv_port
        self._stamp: tuple[int, int] | None = None
        self.last: list[Replica] = []

    async def refresh(self) -> list[Replica]:
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                if stat.st_size > MAX_FILE_SD_BYTES:
                    raise DiscoveryError("too_large", f"file_sd {self.path}: over {MAX_FILE_SD_BYTES} bytes")
                with open(self.path, encoding="utf-8") as handle:
                    text = handle.read(MAX_FILE_SD_BYTES + 1)
                self.last = parse_file_sd(text, self.kv_port, self.path.endswith((".yml", ".yaml")))
                self._stamp = stamp
        except (OSError, UnicodeDecodeError) as err:
            raise DiscoveryError("read_error", f"file_sd {self.path}: {err}") from err
        return self.last


Resolver = Callable[[str], Awaitable[list[str]]]


async def resolve_host(host: str) -> list[str]:
    """A and AAAA answers through the system resolver (so /etc/hosts and cluster DNS alike)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(ipaddress.ip_address(info[4][0])) for info in infos]


class DnsSd:
    """`NAME:PORT` of a headless Service, looked up again every `every` seconds."""

    name = "discovery_dns"

    def __init__(self, target: str, kv_port: int | None, every: float, resolver: Resolver = resolve_host):
        self.host, port = _host_port(target)
        if not self.host or port is None:
            raise ValueError(f"want NAME:PORT, not {target!r}")
        self.port, self.kv_port, self.every, self.resolver = port, kv_port, every, resolver
        self._due = 0.0
        self.last: list[Replica] = []

    async def refresh(self, now: float | None = None) -> list[Replica]:
        now = asyncio.get_running_loop().time() if now is None else now
        if now < self._due:
            return self.last
        self._due = now + self.every
        try:
            addresses = await asyncio.wait_for(self.resolver(self.host), DNS_TIMEOUT_SECONDS)
        except TimeoutError as err:
            raise DiscoveryError("timeout", f"DNS {self.host}: no answer in {DNS_TIMEOUT_SECONDS}s") from err
        except OSError as err:
            raise DiscoveryError("resolve_error", f"DNS {self.host}: {err}") from err
        self.last = from_addresses(addresses, self.port, self.kv_port)
        return self.last
