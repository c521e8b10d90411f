"""How the KV-event streams, their discovery and the fleet publisher are wired (their rows in
server.ROWS): the streams named by the flags, the ones vLLM's (or SGLang's) server says it
publishes, and the publisher they feed. The three share one RankWiring, made once per poll state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from .config import ConfigError
from .derive.fields import Rules
from .derive.front_fields import MAX_FRONT_TOKENS
from .derive.state import PollState, TargetState
from .kv_event_streams import (
    DiscoveredKvEvents,
    DiscoveryPoll,
    PacedDiscovery,
    RankWiring,
    kv_events_poll,
    rank_endpoint,
)
from .model_tokenizer import load_tokenizer, safe_decoder
from .settings import Settings
from .sources.kv_event_sources import KvEventDiscovery, Stream

if TYPE_CHECKING:
    from .collector import Exporter, Poll


def rank_wiring(s: Settings, state: PollState) -> RankWiring:
    """The front namer and the fleet publisher every rank feeds, made at the first ask."""
    wiring = state.parts.get("kv_wiring")
    if wiring is None:
        decode = field_decoder(s)
        rules = Rules.with_patterns(s.fields_patterns) if decode is not None else None  # vetted by config
        publisher = fleet_publisher(s, state) if s.fleet_publish else None
        wiring = state.parts["kv_wiring"] = RankWiring(decode, rules, publisher)
    return wiring


def wire_streams(s: Settings, state: PollState) -> list[Poll]:
    """`--kv-events.endpoint`: one subscriber per rank, each its own seq (the flags win over what
    the server says)."""
    wiring = rank_wiring(s, state)
    if not s.kv_events_endpoint:
        return []
    beside = target_beside(state, s.kv_events_endpoint) or (state.targets[0] if state.targets else None)
    polls = []
    for rank in range(s.kv_events_data_parallel_size):
        stream = Stream(
            rank,
            rank_endpoint(s.kv_events_endpoint, rank),
            s.kv_events_mode,
            s.kv_events_topic,
            s.kv_events_replay_endpoint and rank_endpoint(s.kv_events_replay_endpoint, rank),
            s.kv_events_engine,
        )
        labels = {"engine": str(rank)} if s.kv_events_data_parallel_size > 1 else {}
        polls.append(kv_events_poll(s, state, rank, stream, labels, wiring, beside))
    return polls


def debug_pages(s: Settings, exporter: Exporter) -> None:
    """`--fields.debug-endpoint`: /debug/fields, the redacted shapes of recent fronts."""
    wiring = exporter.state.parts["kv_wiring"]
    if s.fields_debug_endpoint and wiring.decode is not None:
        fronts = wiring.fronts
        exporter.debug_pages = {"/debug/fields": lambda: {e: f.report() for e, f in fronts.items()}}


def wire_discovery(s: Settings, state: PollState) -> list[Poll]:
    """Unless an endpoint is named: ask the first engine where each rank publishes (one set of
    streams, as with the flags); a rank it finds is polled from the next poll on."""
    if s.kv_events_endpoint or s.kv_events_discovery != "on":
        return []
    first = state.targets[0] if state.targets else None
    discovered = DiscoveredKvEvents(s, state, rank_wiring(s, state), target=first)
    state.parts["kv_event_discovery"] = discovered
    asked = next(iter(state.parts["engines"].values()))
    source = KvEventDiscovery(asked.url, s.vllm_timeout, s.engine_kind, headers=asked.headers)
    return [DiscoveryPoll(PacedDiscovery(source, first, time.monotonic), discovered.into, view=discovered)]


def discovery_built(s: Settings, exporter: Exporter) -> None:
    if (discovered := exporter.state.parts.get("kv_event_discovery")) is not None:
        discovered.polls = exporter.polls  # the engine's own list: a rank found later joins it


def wire_publisher(s: Settings, state: PollState) -> list[Poll]:
    """`--fleet.publish`: the publisher's poll (its health series); the streams feed it."""
    publisher = rank_wiring(s, state).publisher
    if publisher is None:
        return []
    from .fleet_publish import PublishPoll  # here: nats-py only when publishing

    return [PublishPoll(publisher, lambda _snapshot, _ts: None)]


def target_beside(state: PollState, endpoint: str) -> TargetState | None:
    """The polled vLLM on the KV endpoint's host (a wildcard or ipc endpoint names none)."""
    host = urlsplit(endpoint).hostname if "://" in endpoint else None
    return next((t for t in state.targets if urlsplit(f"//{t.name}").hostname == host), None)


def field_decoder(s: Settings) -> Callable[[list[int]], str] | None:
    """The model's tokenizer as a front decoder (derive/front_fields.py); None without one."""
    if not s.fields_tokenizer:
        return None
    try:
        tokenizer = load_tokenizer(s.fields_tokenizer, "pip install tokenizers")
    except ValueError as err:
        raise ConfigError(f"--fields.tokenizer: {err}") from None
    return safe_decoder(tokenizer, MAX_FRONT_TOKENS)


def fleet_publisher(s: Settings, state: PollState):
    """This replica's residency deltas and counters to NATS (fleet_publish.py)."""
    from .fleet_publish import FleetPublisher, NatsOptions  # here: nats-py only when publishing

    assert s.fleet_publish is not None and s.fleet_replica is not None  # config.checks
    options = NatsOptions(
        s.fleet_publish, s.fleet_credentials_file, s.fleet_nkey_seed_file, s.fleet_tls_ca_file
    )
    publisher = FleetPublisher(
        options,
        s.fleet_pool,
        s.fleet_replica,
        s.fleet_subject_prefix,
        s.fleet_hash_sampling,
        counters=lambda: state.targets[0].snapshot if state.targets else None,
    )
    publisher.start()  # needs the running event loop, as the KV-event subscribers
    return publisher
