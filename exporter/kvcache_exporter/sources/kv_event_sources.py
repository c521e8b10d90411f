"""Where an engine publishes its KV events, asked of the engine itself: vLLM's /kv_event_sources,
SGLang's /server_info.

An engine is a route and a small pure parser (`ENGINES`): the parser turns the decoded JSON answer
into `Announced` entries, one per data-parallel rank. `resolve` then turns each into a `Stream` to
subscribe to. The answer is data from the network, so it never picks a target: only tcp, the host
is always the one we polled (a wildcard bind address or any other host is replaced by it), a port
in 1-65535, at most MAX_RANKS ranks from a body of at most MAX_BODY_BYTES, bounded topics; every
entry left out is counted by reason. See docs/kv-events.md, "Discovery".
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from .base import SourceError
from .http import HttpStatusError, Session, new_session

MAX_BODY_BYTES = 64 * 1024  # vLLM answers ~250 bytes a rank
MAX_RANKS = 64  # one subscriber socket and thread each
MAX_FIELD_CHARS = 256  # an endpoint or a topic
WILDCARDS = ("*", "0.0.0.0", "::", "")
PROBE_SECONDS = 1.0  # is a concrete endpoint already listening (vLLM bound it)?
LOGGED_RANKS = 8  # the rest of a large answer is counted in the log line, not listed


@dataclass(frozen=True)
class Announced:
    """One rank's publisher as the engine reports it (nothing checked yet)."""

    rank: int
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


@dataclass(frozen=True)
class Stream:
    """A rank's publisher as we subscribe to it: `endpoint` on the polled host; `mode` is our side's
    (vLLM binds a wildcard, so we connect; it connects to a concrete address, so we bind there)."""

    rank: int
    endpoint: str
    mode: str
    topic: str = ""
    replay_endpoint: str | None = None
    engine: str = "vllm"  # sources/engine_events.py: whose media and page rules the events follow


@dataclass(frozen=True)
class Found:
    """One answer: the streams to follow, entries left out by reason, ranks whose host was replaced."""

    streams: tuple[Stream, ...] = ()
    rejected: Counter[str] = field(default_factory=Counter)
    other_host: tuple[int, ...] = ()
    state: str = "found"  # found | none_published | no_route
    asked: str = "vLLM's /kv_event_sources"  # the route(s) asked, for the log line (Engine.title)

    def describe(self) -> str:
        """The one log line: what was found, what was left out. No topic text (it is data)."""
        if self.state == "no_route":
            hint = " (vLLM before 0.32?)" if "/kv_event_sources" in self.asked else ""
            return f"no such route{hint}: give --kv-events.endpoint"
        if self.state == "none_published":
            parts = [
                "the engine publishes no KV events (start it with --kv-events-config: docs/kv-events.md)"
            ]
        else:
            parts = [f"rank {s.rank} {s.endpoint} ({s.mode})" for s in self.streams[:LOGGED_RANKS]]
            if len(self.streams) > LOGGED_RANKS:
                parts[-1] += f" and {len(self.streams) - LOGGED_RANKS} more"
        if self.other_host:
            parts.append(f"host of rank {', '.join(map(str, self.other_host))} replaced by the polled one")
        if self.rejected:
            parts.append("left out: " + ", ".join(f"{n} {r}" for r, n in sorted(self.rejected.items())))
        return "; ".join(parts)


@dataclass
class Settled:
    """The answer in force: the first as it comes, a change once two answers in a row agree (an
    answer that changes every poll moves nothing); a failed ask (None) leaves it standing."""

    found: Found | None = None
    pending: Found | None = None
    changes: int = 0

    def offer(self, found: Found | None) -> bool:
        """True when `found` is now in force."""
        if found is None or found == self.found:
            self.pending = None
            return False
        if self.found is not None and found != self.pending:
            self.pending = found
            return False
        if self.found is not None:
            self.changes += 1
        self.found, self.pending = found, None
        return True


class Rejected(ValueError):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _rank(value: Any) -> int:
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 6:
        value = int(value)
    if type(value) is not int:
        raise Rejected("bad_rank")
    if not 0 <= value < MAX_RANKS:
        raise Rejected("rank_out_of_range")
    return value


def _text(value: Any, default: str | None = None) -> str | None:
    if value is None:
        return default
    if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS:
        raise Rejected("bad_field")
    return value


def _vllm_entry(rank: Any, entry: Any) -> Announced | None:
    """None: a rank that publishes nothing (publisher "null")."""
    if not isinstance(entry, dict):
        raise Rejected("bad_entry")
    if entry.get("publisher", "zmq") != "zmq" or entry.get("enable_kv_cache_events") is False:
        return None
    endpoint = _text(entry.get("endpoint"))
    if endpoint is None:
        raise Rejected("bad_field")
    topic = _text(entry.get("topic"), "")
    return Announced(_rank(rank), endpoint, _text(entry.get("replay_endpoint")), topic or "")


def parse_vllm(answer: Any) -> tuple[list[Announced], Counter[str]]:
    """vLLM 0.32/0.33: `{"<rank>": KVEventsConfig, ...}`; newer: a list of `{data_parallel_rank,
    endpoint, replay_endpoint, topic}`, bare or as `{"sources": [...]}`."""
    if isinstance(answer, dict) and isinstance(answer.get("sources"), list):
        answer = answer["sources"]
    if isinstance(answer, list):
        pairs = [(e.get("data_parallel_rank") if isinstance(e, dict) else None, e) for e in answer]
    elif isinstance(answer, dict):
        pairs = list(answer.items())
    else:
        raise SourceError("parse_error", "want a JSON object or list of KV-event sources")
    found: dict[int, Announced] = {}
    rejected: Counter[str] = Counter()
    if len(pairs) > MAX_RANKS:
        rejected["too_many_ranks"] += len(pairs) - MAX_RANKS
        pairs = pairs[:MAX_RANKS]
    for rank, entry in pairs:
        try:
            announced = _vllm_entry(rank, entry)
        except Rejected as err:
            rejected[err.reason] += 1
            continue
        if announced is None:
            continue
        if announced.rank in found:
            rejected["duplicate_rank"] += 1
            continue
        found[announced.rank] = announced
    return sorted(found.values(), key=lambda a: a.rank), rejected


def _port(value: Any) -> int:
    if type(value) is not int or not 0 < value < 65536:
        raise Rejected("bad_port")
    return value


def parse_sglang(answer: Any) -> tuple[list[Announced], Counter[str]]:
    """SGLang's GET /server_info: `kv_events` = {publisher, endpoint_host, endpoint_port_base, topic,
    block_size, dp_size, replay_endpoint_port_base}; rank r publishes on the base port + r."""
    if not isinstance(answer, dict):
        raise SourceError("parse_error", "want a JSON object from /server_info")
    config = answer.get("kv_events")
    rejected: Counter[str] = Counter()
    if config is None or (isinstance(config, dict) and config.get("publisher", "zmq") != "zmq"):
        return [], rejected  # SGLang started without --kv-events-config
    try:
        if not isinstance(config, dict):
            raise Rejected("bad_entry")
        host = _text(config.get("endpoint_host"), "*") or "*"
        base = _port(config.get("endpoint_port_base"))
        replay = config.get("replay_endpoint_port_base")
        replay = None if replay is None else _port(replay)
        topic = _text(config.get("topic"), "") or ""
        size = config.get("dp_size", 1)
        if type(size) is not int or size < 1:
            raise Rejected("bad_rank")
    except Rejected as err:
        rejected[err.reason] += 1
        return [], rejected
    if size > MAX_RANKS:
        rejected["too_many_ranks"] += size - MAX_RANKS
        size = MAX_RANKS
    host = _bracketed(host)
    announced = []
    for rank in range(size):
        if base + rank > 65535 or (replay is not None and replay + rank > 65535):
            rejected["bad_port"] += 1
            continue
        replay_endpoint = None if replay is None else f"tcp://{host}:{replay + rank}"
        announced.append(Announced(rank, f"tcp://{host}:{base + rank}", replay_endpoint, topic))
    return announced, rejected


@dataclass(frozen=True)
class Engine:
    name: str  # Stream.engine: whose media and page rules its events follow
    path: str
    parse: Callable[[Any], tuple[list[Announced], Counter[str]]]
    max_body_bytes: int = MAX_BODY_BYTES
    title: str = ""  # how a log line names the route: "SGLang's /server_info"


# SGLang's /server_info is every server argument (~43 KB for a tiny model): a larger bound
ENGINES = {
    "vllm": Engine("vllm", "/kv_event_sources", parse_vllm, title="vLLM's /kv_event_sources"),
    "sglang": Engine("sglang", "/server_info", parse_sglang, 1024 * 1024, "SGLang's /server_info"),
}


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def on_host(endpoint: str, host: str) -> tuple[str, bool, bool]:
    """`endpoint` with `host` in place of its own: (endpoint, vLLM binds it, it named another host).
    Rejected unless tcp://HOST:PORT with 0 < PORT < 65536."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        raise Rejected("not_tcp")
    named, colon, port = rest.rpartition(":")
    if not colon or not (port.isascii() and port.isdigit()) or len(port) > 5:
        raise Rejected("bad_port")
    if int(port) == 0:
        raise Rejected("port_not_bound")  # `tcp://*:0` before the engine reported the port it got
    if int(port) > 65535:
        raise Rejected("bad_port")
    named = named.removeprefix("[").removesuffix("]")
    binds = named in WILDCARDS
    other = not binds and named.lower() != host.lower()
    return f"tcp://{_bracketed(host)}:{int(port)}", binds, other


def resolve(
    announced: list[Announced], host: str, rejected: Counter[str] | None = None, engine: str = "vllm"
) -> Found:
    """The streams to subscribe to on `host` (the polled one), never another."""
    rejected = Counter(rejected or {})
    streams, other = [], []
    for entry in announced:
        try:
            endpoint, binds, named_other = on_host(entry.endpoint, host)
        except Rejected as err:
            rejected[err.reason] += 1
            continue
        replay = None
        if entry.replay_endpoint:
            try:
                replay = on_host(entry.replay_endpoint, host)[0]  # vLLM's ROUTER binds: we connect
            except Rejected as err:
                rejected[f"replay_{err.reason}"] += 1
        mode = "connect" if binds else "bind"
        streams.append(Stream(entry.rank, endpoint, mode, entry.topic, replay, engine))
        if named_other:
            other.append(entry.rank)
    state = "found" if streams else "none_published"
    return Found(tuple(streams), rejected, tuple(other), state)


def sources_url(metrics_url: str, path: str) -> tuple[str, str]:
    """(the route's URL on the server of `metrics_url`, its host): `--vllm.url`'s host, never the data's."""
    parts = urlsplit(metrics_url)
    return urlunsplit((parts.scheme, parts.netloc, path, "", "")), parts.hostname or ""


class KvEventDiscovery:
    """Asks one server where its KV-event publishers are, every poll (a static table: one small GET).
    A missing route is an answer (state no_route), not a failure; anything else malformed raises.
    `engine="auto"`: vLLM's route, and SGLang's where the server has no such route (then SGLang's
    first from the next ask on)."""

    name = "kv_event_discovery"

    def __init__(
        self,
        metrics_url: str,
        timeout: float = 5.0,
        engine: str = "vllm",
        keep_alive: bool = True,
        headers: Callable[[], dict[str, str]] = dict,  # e.g. the bearer token /metrics is polled with
    ):
        self.engines = [ENGINES["vllm"], ENGINES["sglang"]] if engine == "auto" else [ENGINES[engine]]
        self.metrics_url = metrics_url
        self.url, self.host = sources_url(metrics_url, self.engine.path)
        self.timeout, self.keep_alive, self.headers = timeout, keep_alive, headers
        self._session: Session | None = None
        self._modes: dict[str, str] = {}  # a concrete endpoint -> our side's mode, decided once

    @property
    def engine(self) -> Engine:
        return self.engines[0]

    async def collect(self) -> Found:
        for _ in self.engines:
            body = await self.ask()
            if body is not None:
                return await self.settle_modes(read_answer(body, self.engine, self.host, self.url))
            if len(self.engines) > 1:  # no such route: the other engine's from now on
                self.engines.append(self.engines.pop(0))
                self.url = sources_url(self.metrics_url, self.engine.path)[0]
        return Found(state="no_route", asked=" or ".join(e.title for e in self.engines))

    async def ask(self) -> bytes | None:
        """The route's body; None where the server has no such route (404)."""
        if self._session is None:
            self._session = new_session(self.keep_alive)
        try:
            async with asyncio.timeout(self.timeout):
                headers = {"Accept": "application/json", **self.headers()}
                return await self._session.get(self.url, headers, self.engine.max_body_bytes)
        except HttpStatusError as err:
            if err.status == 404:
                return None
            raise
        except TimeoutError as err:
            raise SourceError("timeout", f"{self.url}: no whole answer within {self.timeout:g}s") from err
        except OSError as err:
            raise SourceError("connection", f"{self.url}: {err}") from err

    async def settle_modes(self, found: Found) -> Found:
        """A concrete address is where vLLM connects (we bind), unless it is the one vLLM bound itself:
        vLLM 0.32 binds `tcp://*:0` on the node's IP and reports that address. So something already
        listening there, on the polled host, is vLLM's PUB: we connect. Decided once per endpoint
        (later, our own bind would answer), all endpoints probed at once within the timeout."""
        unknown = {s.endpoint for s in found.streams if s.mode == "bind" and s.endpoint not in self._modes}
        if len(self._modes) + len(unknown) > 4 * MAX_RANKS:  # an answer that changes every poll
            self._modes.clear()
        ports = {e: int(e.rpartition(":")[2]) for e in unknown}
        probe_timeout = min(self.timeout, PROBE_SECONDS)
        listening = await asyncio.gather(
            *(accepts(self.host, port, probe_timeout) for port in ports.values())
        )
        self._modes.update({e: "connect" if up else "bind" for e, up in zip(ports, listening, strict=True)})
        streams = tuple(replace(s, mode=self._modes.get(s.endpoint, s.mode)) for s in found.streams)
        return replace(found, streams=streams)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


async def accepts(host: str, port: int, timeout: float) -> bool:
    """Whether `host:port` accepts a TCP connection (closed at once, nothing sent)."""
    try:
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except (OSError, TimeoutError):
        return False
    writer.close()
    return True


def read_answer(body: bytes, engine: Engine, host: str, url: str = "the answer") -> Found:
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError) as err:  # RecursionError: deeply nested arrays
        raise SourceError("parse_error", f"{url}: not JSON ({type(err).__name__})") from err
    announced, rejected = engine.parse(answer)
    return replace(resolve(announced, host, rejected, engine.name), asked=engine.title)
