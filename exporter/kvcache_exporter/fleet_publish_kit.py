"""What the fleet publisher (`serve --fleet.publish`, fleet_publish.py) declares beside its code: its
catalog entries, its options, its settings and their checks. catalog.py and config.py concatenate
them in their place; server.ROWS wires it (kv_event_rows.wire_publisher). `aggregate` takes the
options it shares (pool, subject prefix, credentials) from here (fleet_view_kit._twin)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .metric import entry
from .options import Option, nats_url, sampling, subject_prefix, subject_token
from .sources.kv_events_kit import events_configured

OPTIONS = (
    Option("fleet.publish", nats_url, None, "NATS JetStream URL to publish this replica's residency to"),
    Option("fleet.pool", subject_token, "default", "the model pool's name in NATS subjects"),
    Option("fleet.replica", subject_token, None, "this replica's name in NATS subjects (default: $POD_NAME)"),
    Option("fleet.hash_sampling", sampling, 1.0, "fraction of block hashes published (0 < f <= 1)"),
    Option("fleet.subject_prefix", subject_prefix, "kvcache", "first tokens of the pool's NATS subjects"),
    Option("fleet.credentials_file", str, None, "NATS credentials file (JWT and NKey seed, .creds)"),
    Option("fleet.nkey_seed_file", str, None, "NATS NKey seed file"),
    Option("fleet.tls_ca_file", str, None, "CA certificate(s) to verify the NATS server with"),
)


@dataclass(frozen=True)
class FleetPublishSettings:
    """One field per option above (config.resolve fills them; Settings has them)."""

    fleet_publish: str | None
    fleet_pool: str
    fleet_replica: str | None
    fleet_hash_sampling: float
    fleet_subject_prefix: str
    fleet_credentials_file: str | None
    fleet_nkey_seed_file: str | None
    fleet_tls_ca_file: str | None


def from_environment(values: dict[str, Any], environ: dict[str, str]) -> None:
    """The replica is the pod (Kubernetes' downward API) when no option names it."""
    if not values["fleet.replica"]:
        try:
            values["fleet.replica"] = subject_token(environ.get("POD_NAME", ""))
        except ValueError:
            values["fleet.replica"] = None


def checks(s: Any) -> list[tuple[str, str]]:
    """`s`: serve's Settings (these fields and the KV events')."""
    out = []
    if s.fleet_publish and not s.fleet_replica:
        out.append(("--fleet.replica", "--fleet.publish needs this replica's name (or $POD_NAME)"))
    if s.fleet_publish and not events_configured(s):
        out.append(("--fleet.publish", "publishes KV events: --kv-events.endpoint or discovery on"))
    return out


FLEET_PUBLISHED_TOTAL = "kvcache_fleet_published_total"
FLEET_PUBLISH_DROPPED_TOTAL = "kvcache_fleet_publish_dropped_total"
FLEET_PUBLISH_BUFFERED = "kvcache_fleet_publish_buffered"
FLEET_PUBLISH_LAG_SECONDS = "kvcache_fleet_publish_lag_seconds"
FLEET_PUBLISH_RESYNCS_TOTAL = "kvcache_fleet_publish_resyncs_total"
FLEET_PUBLISH_RESYNCED_BLOCKS_TOTAL = "kvcache_fleet_publish_resynced_blocks_total"
FLEET_PUBLISH_RESYNC_PENDING = "kvcache_fleet_publish_resync_pending"

METRICS = (
    entry(
        FLEET_PUBLISHED_TOTAL,
        "counter",
        "Messages (residency deltas, counters) the sidecar published to NATS JetStream and JetStream acked.",
        (),
        "messages",
        "fleet",
        "serve --fleet.publish",
    ),
    entry(
        FLEET_PUBLISH_DROPPED_TOTAL,
        "counter",
        "Messages the sidecar did not publish: buffer_full (NATS slower than the stream, or down, and the "
        "bounded buffer full), publish_error (no JetStream ack after 3 tries of 2 s, or an error another "
        "try cannot mend), not_connected. The shards "
        "count the lost deltas as kvcache_kv_events_missed_batches_total.",
        ("reason",),
        "messages",
        "fleet",
        "serve --fleet.publish",
    ),
    entry(
        FLEET_PUBLISH_BUFFERED,
        "gauge",
        "Messages waiting in the sidecar's bounded buffer for NATS.",
        (),
        "messages",
        "fleet",
        "serve --fleet.publish",
    ),
    entry(
        FLEET_PUBLISH_LAG_SECONDS,
        "gauge",
        "How long the oldest message in the sidecar's buffer has waited for NATS (0 when empty): "
        "publisher lag.",
        (),
        "seconds",
        "fleet",
        "serve --fleet.publish",
    ),
    entry(
        FLEET_PUBLISH_RESYNCS_TOTAL,
        "counter",
        "Times the sidecar's buffer overflowed (NATS down or slow) and the sidecar then resent the "
        "batches from vLLM's replay endpoint: done (the shards see no gap), failed (replay had no "
        "longer the batches, vLLM restarted meanwhile, no replay endpoint: the shards count the gap "
        "as kvcache_kv_events_missed_batches_total, as without replay).",
        ("result",),
        "resyncs",
        "fleet",
        "serve --fleet.publish",
    ),
    entry(
        FLEET_PUBLISH_RESYNCED_BLOCKS_TOTAL,
        "counter",
        "Block hashes (stored or removed) published from vLLM's replay after a buffer overflow.",
        (),
        "blocks",
        "fleet",
        "serve --fleet.publish",
    ),
    entry(
        FLEET_PUBLISH_RESYNC_PENDING,
        "gauge",
        "1 while the sidecar holds back its KV events after a buffer overflow, until NATS has taken "
        "the buffer and vLLM's replay resends them; else 0.",
        (),
        "",
        "fleet",
        "serve --fleet.publish",
    ),
)
