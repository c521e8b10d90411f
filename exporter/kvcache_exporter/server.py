"""`serve`: wire settings into sources and the poll loop (service.py runs it behind the HTTP server)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from urllib.parse import urlsplit

from . import kit
from .collector import Exporter, Poll, target_polls
from .config import ConfigError
from .derive.cost import Pricing
from .derive.fields import Rules
from .derive.front_fields import MAX_FRONT_TOKENS
from .derive.registry import DERIVATIONS, DeriveOptions
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
from .sources.base import SourceUnavailable
from .sources.gpu_factory import make_gpu_source
from .sources.kv_event_sources import KvEventDiscovery, Stream
from .sources.sglang import EngineSource

log = logging.getLogger("kvcache_exporter")


def build_exporter(s: Settings, clock: Callable[[], float] = time.time) -> Exporter:
    """Every source as one Poll into one PollState: the built-in sources wired below, then every
    registered source's row (kit.py: its own polls, state part and derivations)."""
    state = PollState(retention=max(s.collect_windows) + 2 * s.collect_interval)
    vllm = {
        urlsplit(url).netloc: EngineSource(
            url, s.vllm_timeout, s.vllm_max_body_bytes, s.vllm_bearer_token_file, kind=s.engine_kind
        )
        for url in s.vllm_url
    }
    polls = target_polls(state, vllm)
    first = state.targets[0] if state.targets else None
    for target in state.targets:  # `auto`: vllm until the first page says otherwise
        target.engine_kind = "sglang" if s.engine_kind == "sglang" else "vllm"
    try:
        gpu = make_gpu_source(
            s.gpu_source,
            devices=s.gpu_devices or None,
            max_processes=s.gpu_max_processes,
            dcgm_url=s.gpu_dcgm_url,
            pod_name=s.gpu_pod,  # $POD_NAME already applied by config
            pod_namespace=s.gpu_namespace,
            gpu_uuids=s.gpu_uuids or None,
            timeout_seconds=s.gpu_dcgm_timeout,
        )
    except SourceUnavailable as off:  # no collector at all, so nothing reads as failing
        log.info("GPU telemetry off: %s", off)
    else:
        polls.append(Poll(gpu, state.add_gpu().ingest))
    state.host_tier_bytes = s.whatif_host_tier_bytes
    decode = field_decoder(s)
    wiring = RankWiring(
        decode,
        Rules.with_patterns(s.fields_patterns) if decode is not None else None,  # vetted by config
        fleet_publisher(s, state) if s.fleet_publish else None,
    )
    if s.kv_events_endpoint:  # the flags win over what vLLM says
        for rank in range(s.kv_events_data_parallel_size):  # one publisher per rank, each its own seq
            stream = Stream(
                rank,
                rank_endpoint(s.kv_events_endpoint, rank),
                s.kv_events_mode,
                s.kv_events_topic,
                s.kv_events_replay_endpoint and rank_endpoint(s.kv_events_replay_endpoint, rank),
                s.kv_events_engine,
            )
            labels = {"engine": str(rank)} if s.kv_events_data_parallel_size > 1 else {}
            beside = target_beside(state, s.kv_events_endpoint) or first
            polls.append(kv_events_poll(s, state, rank, stream, labels, wiring, beside))
    discovered = None
    if not s.kv_events_endpoint and s.kv_events_discovery == "on":
        discovered = DiscoveredKvEvents(s, state, wiring, target=first)
        asked = next(iter(vllm.values()))  # the first vLLM: one set of streams, as with the flags
        source = KvEventDiscovery(asked.url, s.vllm_timeout, s.engine_kind, headers=asked.headers)
        source = PacedDiscovery(source, first, time.monotonic)
        polls.append(DiscoveryPoll(source, discovered.into, view=discovered))
    if wiring.publisher is not None:
        from .fleet_publish import PublishPoll

        polls.append(PublishPoll(wiring.publisher, lambda _snapshot, _ts: None))
    options = DeriveOptions(
        windows=tuple(sorted(s.collect_windows)),
        quantiles=tuple(s.collect_quantiles),
        pricing=pricing_from(s),
        gpu_count=s.cost_gpu_count,
        gpu_memory_utilization_ceiling=s.audit_gpu_memory_utilization_ceiling,
    )
    polls += kit.wire(s, state)
    # past every source's own timeout
    deadline = max(2 * s.collect_interval, s.vllm_timeout + 1, s.gpu_dcgm_timeout + 1, 10.0)
    derivations = DERIVATIONS | kit.derivations()
    exporter = Exporter(
        polls,
        state,
        options,
        interval=s.collect_interval,
        clock=clock,
        deadline=deadline,
        derivations=derivations,
    )
    if discovered is not None:
        discovered.polls = exporter.polls  # a rank found later is polled from the next poll on
    if s.fields_debug_endpoint and decode is not None:
        fronts = wiring.fronts
        exporter.debug_pages = {"/debug/fields": lambda: {e: f.report() for e, f in fronts.items()}}
    return exporter


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
    """`--fleet.publish`: this replica's residency deltas and counters to NATS (fleet_publish.py)."""
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


def pricing_from(settings: Settings) -> Pricing:
    table: dict[str, float] = dict(settings.cost_gpu_hour_prices)
    if table and settings.cost_gpu_hour_price is not None:
        table.setdefault("default", settings.cost_gpu_hour_price)
    return Pricing(
        gpu_hour_price=table or settings.cost_gpu_hour_price,
        currency=settings.cost_currency,
        energy_price_per_kwh=settings.cost_energy_price_per_kwh,
        hit_ratio_floor=settings.cost_hit_ratio_floor,
    )
