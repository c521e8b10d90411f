"""What the KV-event source (sources/kv_events.py: the streams, their discovery, miss attribution and
the hit-unit view) declares beside its code: its catalog entries (EVENTS, UNITS, ATTRIBUTION, each in
its place in catalog.py), its options (the what-if's and field naming's too: they read the streams),
its settings and their checks. server.ROWS wires it (kv_event_rows.py). The options `aggregate`
shares (topic, batch budget, discovery) keep their fields in settings.ServiceSettings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..metric import entry
from ..options import (
    MAX_DATA_PARALLEL_SIZE,
    Option,
    at_least,
    between,
    choice,
    named_patterns,
    on_off,
    size,
    zmq_endpoint,
)

KV_EVENTS_BATCHES_TOTAL = "kvcache_kv_events_batches_total"
KV_EVENTS_TOTAL = "kvcache_kv_events_total"
KV_EVENTS_MISSED_BATCHES_TOTAL = "kvcache_kv_events_missed_batches_total"
KV_EVENTS_PUBLISHER_RESTARTS_TOTAL = "kvcache_kv_events_publisher_restarts_total"
KV_EVENTS_DROPPED_TOTAL = "kvcache_kv_events_dropped_total"
KV_EVENTS_CACHED_BLOCKS = "kvcache_kv_events_cached_blocks"
KV_EVENTS_DISCOVERED_ENDPOINTS = "kvcache_kv_events_discovered_endpoints"
KV_EVENTS_DISCOVERY_STATE = "kvcache_kv_events_discovery_state"
KV_EVENTS_PUBLISHER_STATE = "kvcache_kv_events_publisher_state"
KV_EVENTS_DISCOVERY_REJECTED = "kvcache_kv_events_discovery_rejected"
KV_EVENTS_DISCOVERY_CHANGES_TOTAL = "kvcache_kv_events_discovery_changes_total"
KV_EVENTS_GROUP_INFO = "kvcache_kv_events_group_info"
KV_EVENTS_HIT_UNIT_TOKENS = "kvcache_kv_events_hit_unit_tokens"
KV_EVENTS_STORED_TOKENS_TOTAL = "kvcache_kv_events_stored_tokens_total"
KV_EVENTS_REUSED_TOKENS_TOTAL = "kvcache_kv_events_reused_tokens_total"
KV_EVENTS_SESSION_TOKENS_TOTAL = "kvcache_kv_events_session_tokens_total"
KV_EVENTS_SESSION_ID_RATIO = "kvcache_kv_events_session_id_ratio"
KV_EVENTS_WINDOW_EVICTIONS_TOTAL = "kvcache_kv_events_window_evictions_total"
KV_EVENTS_TIER_BLOCKS = "kvcache_kv_events_tier_blocks"
KV_EVENTS_TIER_BYTES = "kvcache_kv_events_tier_bytes"
KV_EVENTS_TIER_HIT_TOKENS_TOTAL = "kvcache_kv_events_tier_hit_tokens_total"
PREFIX_CACHE_MISS_TOKENS_TOTAL = "kvcache_prefix_cache_miss_tokens_total"
PREFIX_CACHE_REORDER_HIT_TOKENS_TOTAL = "kvcache_prefix_cache_reorder_hit_tokens_total"
PREFIX_CACHE_UNORDERED_EVENTS_TOTAL = "kvcache_prefix_cache_unordered_events_total"
KV_EVENTS_DECODE_TOKENS_TOTAL = "kvcache_kv_events_decode_tokens_total"
PREFIX_DIVERGENCE_OFFSET_TOKENS = "kvcache_prefix_divergence_offset_tokens"
PREFIX_DIVERGED_FIELD_TOKENS_TOTAL = "kvcache_prefix_diverged_field_tokens_total"
PREFIX_HISTORY_REWRITTEN_TURN = "kvcache_prefix_history_rewritten_turn"
PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED = "kvcache_prefix_cache_miss_attribution_tracked"
PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED_LIMIT = "kvcache_prefix_cache_miss_attribution_tracked_limit"
PREFIX_CACHE_MISS_ATTRIBUTION_COVERAGE_RATIO = "kvcache_prefix_cache_miss_attribution_coverage_ratio"
PREFIX_CACHE_MISS_ATTRIBUTION_EXCESS_TOKENS = "kvcache_prefix_cache_miss_attribution_excess_tokens"
PREFIX_CACHE_HIT_RATIO_ESTIMATE = "kvcache_prefix_cache_hit_ratio_estimate"
PREFIX_CACHE_HIT_RATIO_REORDERED_ESTIMATE = "kvcache_prefix_cache_hit_ratio_reordered_estimate"
PREFIX_CACHE_HIT_RATIO_REORDERED_LAYOUT_ESTIMATE = "kvcache_prefix_cache_hit_ratio_reordered_layout_estimate"
PREFIX_CACHE_HIT_RATIO_HOST_TIER_ESTIMATE = "kvcache_prefix_cache_hit_ratio_host_tier_estimate"
HOST_TIER_LOAD_BYTES_PER_SECOND_ESTIMATE = "kvcache_host_tier_load_bytes_per_second_estimate"

EVENTS = (
    entry(
        KV_EVENTS_BATCHES_TOTAL,
        "counter",
        "KV-event batches received from vLLM's ZMQ stream.",
        (),
        "",
        "events",
        "vLLM KV-event stream",
    ),
    entry(
        KV_EVENTS_TOTAL,
        "counter",
        "KV events received, by type (BlockStored, BlockRemoved, AllBlocksCleared).",
        ("type",),
        "",
        "events",
        "vLLM KV-event stream",
    ),
    entry(
        KV_EVENTS_MISSED_BATCHES_TOTAL,
        "counter",
        "Batches lost: gaps in the sequence numbers not filled by replay.",
        (),
        "",
        "events",
        "vLLM KV-event stream sequence numbers",
    ),
    entry(
        KV_EVENTS_PUBLISHER_RESTARTS_TOTAL,
        "counter",
        "Times the stream's sequence went back (or jumped absurdly far): a new publisher, usually a vLLM "
        "restart; the event view is reset and blocks held before read as `restart` misses.",
        (),
        "",
        "events",
        "vLLM KV-event stream sequence numbers",
    ),
    entry(
        KV_EVENTS_DROPPED_TOTAL,
        "counter",
        "Batches the exporter dropped itself: rate_limited (over --kv-events.max-batches-per-second), "
        "too_many_blocks (resident-hash bound), parse_error (undecodable), batch_too_heavy (one batch "
        "over the bytes, hashes or token-ids bound), budget_exceeded (over what one poll may queue or "
        "spend applying); and single events refused with the rest of their batch kept: invalid_event (a "
        "field outside its type or bounds), invalid_block_size (over 65,536, over the token ids the event "
        "carries, or its blocks over 1,048,576 tokens).",
        ("reason",),
        "",
        "events",
        "exporter limits",
    ),
    entry(
        KV_EVENTS_CACHED_BLOCKS,
        "gauge",
        "Blocks in vLLM's prefix-cache hash table according to the event stream (stored minus removed).",
        (),
        "blocks",
        "events",
        "BlockStored, BlockRemoved, AllBlocksCleared",
    ),
    entry(
        KV_EVENTS_DISCOVERED_ENDPOINTS,
        "gauge",
        "KV-event publishers (one per data-parallel rank) found at the first vLLM's /kv_event_sources "
        "and subscribed to (only without --kv-events.endpoint).",
        (),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    entry(
        KV_EVENTS_DISCOVERY_STATE,
        "gauge",
        "1 for the state of KV-event discovery, 0 for the others: unknown (no answer yet), found, "
        "none_published (vLLM runs without --kv-events-config), no_route (a vLLM without "
        "/kv_event_sources: give --kv-events.endpoint).",
        ("state",),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    entry(
        KV_EVENTS_PUBLISHER_STATE,
        "gauge",
        "1 for the state of this rank's KV-event publisher, 0 for the others: connected (a vLLM "
        "publisher holds a connection), disconnected (one did, none does now), never_connected (none "
        "since the subscriber started: a rank past vLLM's data-parallel size, or a wrong endpoint).",
        ("state",),
        "",
        "events",
        "ZMQ socket monitor (accepted, connected, disconnected)",
    ),
    entry(
        KV_EVENTS_DISCOVERY_REJECTED,
        "gauge",
        "Entries of vLLM's current /kv_event_sources answer left out, by reason: not_tcp, bad_port, "
        "port_not_bound, bad_rank, rank_out_of_range, too_many_ranks, duplicate_rank, bad_entry, "
        "bad_field, replay_<reason> (only the replay endpoint left out).",
        ("reason",),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
    entry(
        KV_EVENTS_DISCOVERY_CHANGES_TOTAL,
        "counter",
        "Times vLLM's answer changed (two answers in a row agreeing) and the subscribers were re-pointed: "
        "a vLLM restart on other ports.",
        (),
        "",
        "events",
        "vLLM GET /kv_event_sources",
    ),
)


UNITS = (
    entry(
        KV_EVENTS_GROUP_INFO,
        "gauge",
        "One series per KV-cache group the event stream announced (vLLM's hybrid KV cache): its kind, "
        "sliding window and block sizes (comma-joined when one group uses several). Value 1.",
        ("group", "kind", "sliding_window", "block_size"),
        "",
        "attribution",
        "BlockStored group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window, block_size",
    ),
    entry(
        KV_EVENTS_HIT_UNIT_TOKENS,
        "gauge",
        "Tokens per hit unit: the granularity of vLLM's prefix hits (the full-attention group's block; "
        "256 on DeepSeek-V4 whatever block_size says). Absent before the first store.",
        (),
        "tokens",
        "attribution",
        "BlockStored of the first full-attention group",
    ),
    entry(
        KV_EVENTS_STORED_TOKENS_TOTAL,
        "counter",
        "Tokens vLLM stored on the GPU (computed: prompt units, their below-unit remainder, decode "
        "blocks), each hit unit once whatever the number of groups, by LoRA adapter (`base` without; "
        "the first 10 adapters seen keep their own series, later ones add to `other`).",
        ("adapter",),
        "tokens",
        "attribution",
        "BlockStored lora_name, token_ids",
    ),
    entry(
        KV_EVENTS_REUSED_TOKENS_TOTAL,
        "counter",
        "Prefix-cache hits re-announced by requests with kv_cache_report_mode=full (a BlockStored "
        "without parent whose blocks were all still held): hits, never misses. By adapter as above.",
        ("adapter",),
        "tokens",
        "attribution",
        "BlockStored (parent_block_hash null, hashes resident)",
        "per-adapter hit ratio: reused / (reused + stored)",
    ),
    entry(
        KV_EVENTS_SESSION_TOKENS_TOTAL,
        "counter",
        "Stored (kind=stored) and re-announced (kind=reused) tokens by session id, for the first 10 "
        "sessions seen (later ones add to session=`other`).",
        ("session", "kind"),
        "tokens",
        "attribution",
        "BlockStored session_id",
        "per-session hit ratio: reused / (reused + stored)",
    ),
    entry(
        KV_EVENTS_SESSION_ID_RATIO,
        "gauge",
        "Share of stored tokens whose request carried a session id (request field, X-Session-ID "
        "header or vllm_xargs): is the session id passed end to end? Since start.",
        (),
        "ratio",
        "attribution",
        "BlockStored session_id",
    ),
    entry(
        KV_EVENTS_WINDOW_EVICTIONS_TOTAL,
        "counter",
        "Hit units made unhittable by the removal of a sliding-window or state block while the "
        "full-attention group still held the unit (vLLM's hybrid hit rule needs every group's part).",
        (),
        "",
        "attribution",
        "BlockRemoved of windowed groups",
    ),
    entry(
        KV_EVENTS_TIER_BLOCKS,
        "gauge",
        "Blocks an offload tier holds according to the event stream (events whose medium is not GPU: "
        "CPU, STORAGE...), by medium.",
        ("medium",),
        "blocks",
        "attribution",
        "BlockStored/BlockRemoved medium",
    ),
    entry(
        KV_EVENTS_TIER_BYTES,
        "gauge",
        "kvcache_kv_events_tier_blocks x the bytes of one GPU block (cache_config_info "
        "kv_cache_memory_bytes / num_gpu_blocks), by medium. Absent while that is unknown.",
        ("medium",),
        "bytes",
        "attribution",
        "BlockStored/BlockRemoved medium; vllm:cache_config_info",
    ),
    entry(
        KV_EVENTS_TIER_HIT_TOKENS_TOTAL,
        "counter",
        "Tokens stored on the GPU whose blocks an offload tier held: loads back from that tier (tier "
        "hits), never computed misses. By medium.",
        ("medium",),
        "tokens",
        "attribution",
        "BlockStored medium",
    ),
)


ATTRIBUTION = (
    entry(
        PREFIX_CACHE_MISS_TOKENS_TOTAL,
        "counter",
        "Prompt tokens vLLM computed (stored blocks x block size), by why they were not cached "
        "(docs/kv-events.md, a section per cause): evicted (cache too small), window_expired (a sliding-"
        "window part dropped: --prefix-cache-retention-interval), restart, other_replica, history_rewritten "
        "(the chat template re-renders an earlier turn unlike the model wrote it), prefix_diverged (per-"
        "request content before shared content), content_moved (known sections in another order), "
        "below_hit_unit (shared content shorter than the hit unit), identity_isolated (held under another "
        "LoRA adapter or cache_salt: by design, not a fault), cold (new content). Loads back from an "
        "offload tier are not misses: kvcache_kv_events_tier_hit_tokens_total. The sidecar never sets "
        "other_replica; `kvcache-exporter aggregate` exports cause=other_replica with a `replica` label.",
        ("cause",),
        "tokens",
        "attribution",
        "BlockStored (hashes, parent, token_ids), BlockRemoved, AllBlocksCleared, seq",
        "each stored block classified in stream order; decode-filled blocks excluded",
    ),
    entry(
        PREFIX_CACHE_REORDER_HIT_TOKENS_TOTAL,
        "counter",
        "Of the prefix_diverged miss tokens, those a reorder would have served, per layout: end (the "
        "per-request fields after everything the requests share) or after_template (right after the shared "
        "template, before what follows it such as the question); events past --kv-events.reorder-per-second "
        "count at the ordered ones' rate (kvcache_prefix_cache_unordered_events_total); docs/kv-events.md.",
        ("layout",),
        "tokens",
        "attribution",
        "BlockStored token_ids (anchor fingerprints and the order they came in)",
        "prefix_diverged tokens reached in an earlier order; after_template: up to a branch point",
    ),
    entry(
        PREFIX_CACHE_UNORDERED_EVENTS_TOTAL,
        "counter",
        "Stored prompt events attributed without the anchor order because they came past "
        "--kv-events.reorder-per-second: for them content_moved and prefix_diverged found by order are not "
        "named (their misses read as the other rules say) and the reorder estimate is extrapolated from "
        "the ordered ones. Its rate against the stored events: raise the budget (or 0: every event) when "
        "it stays up and the causes matter more than the CPU.",
        (),
        "events",
        "attribution",
        "BlockStored, the clock",
        "events the token bucket (layouts.OrderBudget) refused",
    ),
    entry(
        KV_EVENTS_DECODE_TOKENS_TOTAL,
        "counter",
        "Tokens of blocks filled during decode (one block extending a request's still-open last block); "
        "not prompt misses.",
        (),
        "tokens",
        "attribution",
        "BlockStored",
    ),
    entry(
        PREFIX_DIVERGENCE_OFFSET_TOKENS,
        "histogram",
        "Where the shared content starts in prompts whose prefix diverged: tokens of per-request front "
        "matter before content the cache already holds. One observation per diverged chain.",
        (),
        "tokens",
        "attribution",
        "BlockStored token_ids, parent_block_hash",
        "chain depth x block size + where the first known content fingerprint starts",
    ),
    entry(
        PREFIX_DIVERGED_FIELD_TOKENS_TOTAL,
        "counter",
        "prefix_diverged miss tokens of the sampled diverged prompts (at most --fields.max-per-second "
        "a second), by the field in front of the known content: the first dynamic field of the decoded "
        "front (timestamp, date, time, uuid, email, url, hex, id, number, template, a --fields.pattern "
        "name, or other). Only with --fields.tokenizer; a share, not a total (docs/kv-events.md).",
        ("field",),
        "tokens",
        "attribution",
        "BlockStored token_ids (decoded with the model's tokenizer)",
        "the front's first tokens decoded and classified by rules (derive/fields.py)",
    ),
    entry(
        PREFIX_HISTORY_REWRITTEN_TURN,
        "histogram",
        "Which rewritten turn of a conversation a history_rewritten miss is: 1 for the first turn whose "
        "earlier answer the chat template re-rendered differently, 2 for the next along the same chain "
        "(the assistant turn where it diverges when every turn is rewritten; counted up to 7). One "
        "observation per history_rewritten stored run.",
        (),
        "",
        "attribution",
        "BlockStored token_ids, parent_block_hash (decode-filled blocks' content)",
        "1 + the history_rewritten runs along the chain before it",
    ),
    entry(
        PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED,
        "gauge",
        "Entries the attribution memory holds: kind=blocks (stored hashes, --kv-events.max-tracked-blocks), "
        "kind=fingerprints (content fingerprints, --kv-events.max-fingerprints). It grows with new content "
        "up to the limit, then forgets its older half.",
        ("kind",),
        "",
        "attribution",
        "BlockStored, BlockRemoved",
    ),
    entry(
        PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED_LIMIT,
        "gauge",
        "The configured bound of kvcache_prefix_cache_miss_attribution_tracked, by kind.",
        ("kind",),
        "",
        "attribution",
        "flags",
    ),
    entry(
        PREFIX_CACHE_MISS_ATTRIBUTION_COVERAGE_RATIO,
        "gauge",
        "Share of the prompt tokens vLLM computed in the window that the KV-event stream attributed to a "
        "cause; low when batches were lost, dropped, or events are off. Absent without computed tokens, "
        "and while more tokens were attributed than computed (kvcache_prefix_cache_miss_attribution_excess_"
        "tokens above 0), as are the window's hit-ratio estimates.",
        ("window",),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total; vllm:prefix_cache_queries_total - "
        "vllm:prefix_cache_hits_total",
        "increase(attributed) / (increase(queries) - increase(hits)); each prompt's last partial "
        "block is never stored, so it sits below 1 by up to block_size - 1 tokens per request",
    ),
    entry(
        PREFIX_CACHE_MISS_ATTRIBUTION_EXCESS_TOKENS,
        "gauge",
        "Prompt tokens the KV-event stream attributed over the window beyond what vLLM computed: a fault "
        "(a broken or hostile publisher, or events running ahead of /metrics), 0 when healthy. While above "
        "0, coverage and the hit-ratio estimates of the window are absent, never clipped to 1.",
        ("window",),
        "tokens",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total; vllm:prefix_cache_queries_total - "
        "vllm:prefix_cache_hits_total",
        "max(increase(attributed) - (increase(queries) - increase(hits)), 0)",
    ),
    entry(
        PREFIX_CACHE_HIT_RATIO_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window had the KV cache been capacity_factor (2, 4) times "
        "larger, from blocks evicted and recomputed soon enough that the larger cache would have kept them.",
        ("window", "capacity_factor"),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=evicted}; vllm:prefix_cache_{hits,queries}_total; "
        "num_gpu_blocks",
        "(increase(hits) + increase(evicted tokens recomputed within (f-1) x num_gpu_blocks stored blocks)) "
        "/ increase(queries); docs/kv-events.md gives the bias",
    ),
    entry(
        PREFIX_CACHE_HIT_RATIO_REORDERED_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window had the per-request fields come after the shared "
        "part: the prefix_diverged tokens (whole hit units of known content behind a per-request front) "
        "would have hit. Equal to the real ratio when nothing diverged.",
        ("window",),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=prefix_diverged}; "
        "vllm:prefix_cache_{hits,queries}_total",
        "(increase(hits) + increase(prefix_diverged tokens)) / increase(queries); docs/kv-events.md",
    ),
    entry(
        PREFIX_CACHE_HIT_RATIO_REORDERED_LAYOUT_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window had the per-request fields been moved, per layout: "
        "layout=end (after everything the requests share) or after_template (right after the shared "
        "template, before what follows it such as the question). Of the prefix_diverged tokens, those "
        "reached in the order earlier requests had them (and, after_template, before the first point "
        "where requests sharing the template went their own ways) would have hit.",
        ("window", "layout"),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=prefix_diverged}; "
        "vllm:prefix_cache_{hits,queries}_total",
        "(increase(hits) + increase(reorder tokens of the layout)) / increase(queries); docs/kv-events.md",
    ),
    entry(
        PREFIX_CACHE_HIT_RATIO_HOST_TIER_ESTIMATE,
        "gauge",
        "Estimated prefix-cache hit ratio over the window with a host (CPU) tier added: "
        "--whatif.host-tier-bytes, else the tier vLLM reports (num_cpu_blocks, kv_offloading_size). Blocks "
        "evicted and recomputed within the tier's size in stored blocks would have been loaded from it. "
        "Absent while no tier size is known.",
        ("window",),
        "ratio",
        "attribution",
        "kvcache_prefix_cache_miss_tokens_total{cause=evicted}; vllm:prefix_cache_{hits,queries}_total; "
        "cache_config_info kv_cache_memory_bytes, kv_cache_size_tokens, block_size",
        "(increase(hits) + increase(evicted tokens recomputed within host_bytes / (bytes per token x block "
        "size) stored blocks)) / increase(queries)",
    ),
    entry(
        HOST_TIER_LOAD_BYTES_PER_SECOND_ESTIMATE,
        "gauge",
        "KV bytes per second the host tier of kvcache_prefix_cache_hit_ratio_host_tier_estimate would load "
        "back into the GPU over the window (its extra hits x KV bytes per token): the transfer it adds.",
        ("window",),
        "bytes/s",
        "attribution",
        "cache_config_info kv_cache_memory_bytes, kv_cache_size_tokens",
        "increase(host-tier hit tokens) x kv_cache_memory_bytes / kv_cache_size_tokens / window seconds",
    ),
)

OPTIONS = (
    Option(
        "kv_events.endpoint",
        zmq_endpoint,
        None,
        "vLLM KV-event ZMQ endpoint, e.g. tcp://127.0.0.1:5557 (default: where vLLM says it publishes)",
    ),
    Option(
        "kv_events.discovery",
        choice("on", "off"),
        "on",
        "ask vLLM's /kv_event_sources where each rank publishes, unless an endpoint is named (on, off)",
    ),
    Option(
        "kv_events.mode",
        choice("bind", "connect"),
        "bind",
        "bind (vLLM connects to a concrete host) or connect",
    ),
    Option(
        "kv_events.replay_endpoint",
        zmq_endpoint,
        None,
        "vLLM's replay ROUTER endpoint, to fill sequence gaps",
    ),
    Option(
        "kv_events.data_parallel_size",
        between(1, MAX_DATA_PARALLEL_SIZE),
        1,
        "vLLM's --data-parallel-size: one stream per rank (rank r on the endpoint's port + r),"
        " each labelled engine=r like vLLM's /metrics",
    ),
    Option("kv_events.topic", str, "", "ZMQ topic to subscribe to"),
    Option(
        "kv_events.max_batches_per_second",
        at_least(1),
        20000,
        "event batches accepted per second, more are dropped",
    ),
    Option(
        "kv_events.max_tracked_blocks",
        at_least(1),
        400_000,
        "block hashes the KV-event view and miss attribution remember (keep >= 10x num_gpu_blocks;"
        " ~350 bytes each with their fingerprints)",
    ),
    Option(
        "kv_events.max_fingerprints",
        at_least(1),
        800_000,
        "content fingerprints miss attribution remembers (~2 per 32 tokens stored; ~70 bytes each)",
    ),
    Option(
        "kv_events.reorder_per_second",
        at_least(0),
        200,
        "stored events a second the reorder estimate reads and learns (10 s of them saved for bursts);"
        " past it an event is attributed without the anchor order, its estimate at the others' rate"
        " (0: every event)",
    ),
    Option(
        "kv_events.engine",
        choice("vllm", "sglang", "trtllm"),
        "vllm",
        "the engine publishing the KV events named by --kv-events.endpoint: its media and page rules"
        " (vllm, sglang, trtllm; discovery sets it from what the server says)",
    ),
    Option(
        "whatif.host_tier_bytes",
        size,
        None,
        "a host (CPU) KV tier to estimate the hit ratio with (default: the tier vLLM reports, if any)",
    ),
    Option(
        "fields.tokenizer",
        str,
        None,
        "the served model's tokenizer.json (or its folder): name the per-request field in front of"
        " diverged prefixes (needs --kv-events.endpoint and the tokenizers library)",
    ),
    Option(
        "fields.patterns",
        named_patterns,
        {},
        "extra named field patterns NAME=REGEX, tried before the built-in ones (at most 8)",
        True,
    ),
    Option("fields.max_per_second", at_least(1), 20, "diverged prompt fronts decoded and named per second"),
    Option(
        "fields.debug_endpoint",
        on_off,
        False,
        "serve /debug/fields (redacted shapes of recent fronts) behind the same auth as /metrics",
    ),
)

SECTIONS = (EVENTS, UNITS, ATTRIBUTION)  # each in its own place in catalog.py
METRICS = EVENTS + UNITS + ATTRIBUTION


@dataclass(frozen=True)
class KvEventsSettings:
    """One field per serve-only option above (config.resolve fills them; Settings has them)."""

    kv_events_endpoint: str | None
    kv_events_mode: str
    kv_events_replay_endpoint: str | None
    kv_events_data_parallel_size: int
    kv_events_max_tracked_blocks: int
    kv_events_max_fingerprints: int
    kv_events_reorder_per_second: int
    kv_events_engine: str
    whatif_host_tier_bytes: int | None
    fields_tokenizer: str | None
    fields_patterns: dict[str, str]
    fields_max_per_second: int
    fields_debug_endpoint: bool


def events_configured(s: Any) -> bool:
    """Whether serve gets KV events at all: an endpoint named, or discovery on."""
    return bool(s.kv_events_endpoint) or s.kv_events_discovery == "on"


def checks(s: Any) -> list[tuple[str, str]]:
    """`s`: serve's Settings (these fields and the shared kv_events_discovery)."""
    out = []
    if s.fields_debug_endpoint and not s.fields_tokenizer:
        out.append(("--fields.debug-endpoint", "needs --fields.tokenizer (it shows the fields that names)"))
    if s.fields_tokenizer and not events_configured(s):
        out.append(("--fields.tokenizer", "needs KV events: --kv-events.endpoint or discovery on"))
    elif s.fields_tokenizer:
        from ..model_tokenizer import load_tokenizer  # here: the tokenizers library only when asked

        try:
            load_tokenizer(s.fields_tokenizer, "pip install tokenizers")
        except ValueError as err:
            out.append(("--fields.tokenizer", str(err)))
    return out
