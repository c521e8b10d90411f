"""docs/metrics.md from the catalog and README's flag tables from the option tables (make
generate; make check fails on drift)."""

from __future__ import annotations

import re

from . import catalog, config
from .sources import sglang_parse

GROUPS = {
    "cache": "Prefix cache and tokens",
    "blocks": "KV blocks",
    "latency": "Latency quantiles",
    "config": "Configuration",
    "gpu": "GPU telemetry",
    "memory": "GPU memory against vLLM's budget",
    "cost": "Cost and energy",
    "events": "KV-event stream",
    "fleet": "Fleet view (`kvcache-exporter aggregate`)",
    "attribution": "Why the cache missed (KV-event attribution)",
    "health": "vLLM schema and exporter health",
    "sglang": "SGLang's radix tree and HiCache (SGLang targets only)",
}

HEADER = """# Metrics

Generated from `exporter/kvcache_exporter/catalog.py` by `make generate`; do not edit.

Every metric carries the labels listed. With more than one `--vllm.url`, the series derived
from vLLM also carry `target` (the server's host:port). Windowed metrics carry `window`
(default `1m`, `5m`, `15m`, `1h`) and are computed by the exporter from its own poll history
(`--collect.interval`), so they do not depend on how often Prometheus scrapes. A window with
no data has no series: never a made-up 0. Counter resets (vLLM restarts) are handled like
PromQL's `rate()`. Formulas for the GPU, memory, audit and cost metrics are explained in
[gpu-cost.md](gpu-cost.md). The aggregator (`kvcache-exporter aggregate`, [fleet.md](fleet.md))
serves the fleet group and, per replica (label `replica`, from discovery), `kvcache_vllm_up`,
`kvcache_kv_events_batches_total`, `kvcache_kv_events_missed_batches_total`,
`kvcache_kv_events_dropped_total` and the collector health series.

How a number gets here: each source's `collect()` returns a snapshot, the poll loop hands it to
the poll state (`derive/state.py`), and pure functions in `derive/` turn that state into samples
when /metrics is read (at most once per poll: a poll nobody reads costs no derivation).
Every source is timed and accounted for the same way (the health group below, `collector` = `vllm`,
`gpu`, `kv_events`; `derive` counts the exporter's own faults). No sample leaves outside the range
its unit allows: ratios 0-1, counts, rates, sizes, durations and money non-negative, everything
finite. Such a sample is dropped and counted as
`kvcache_exporter_errors_total{collector="derive",reason="invalid_value"}`, so a series is right or
absent, never NaN.
"""


TABLE_HEAD = "| name | type | unit | labels | meaning | from | formula |\n|---|---|---|---|---|---|---|"


def _row(m: catalog.Metric) -> str:
    labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
    cells = (f"`{m.name}`", m.type, m.unit or "—", labels, m.help, m.source or "—", m.formula or "—")
    return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"


def metrics_markdown() -> str:
    parts = [HEADER]
    own = {m.group: m.group for m in catalog.CATALOG if m.group not in GROUPS}  # a source's group: its name
    groups = GROUPS | own
    for group, title in groups.items():
        metrics = [m for m in catalog.CATALOG if m.group == group]
        parts.append(f"\n## {title}\n\n{TABLE_HEAD}")
        parts += [_row(m) for m in metrics]
    parts.append(SGLANG)
    parts += [f"| `{name}` | {why} |" for name, why in sglang_parse.ABSENT.items()]
    return "\n".join(parts) + "\n"


SGLANG = """
## SGLang

`--vllm.url` also takes an SGLang server's /metrics URL: `--engine auto` (the default) tells the engine
from each page's metric names, `--engine vllm|sglang` insists (the other engine's page is then an
`errors_total{reason="wrong_engine"}`). An SGLang target's series have the names above plus the label
`engine_kind="sglang"` (a vLLM target's carry no such label: their label sets are unchanged). The hit
ratio is `sglang:cached_tokens_total` summed over `cache_source` (or its single `total` series) over
`sglang:prompt_tokens_total`, never the `sglang:cache_hit_rate` gauge (the last prefill batch's ratio).
SGLang's start-up warm-up request is in every one of its counters, so in the lifetime totals here
(a window that starts after it does not hold it); nothing is discounted. Only tensor/pipeline/expert
rank 0 is read (the others repeat it); data-parallel ranks are summed into engine `0`. KV events are
found from SGLang's `/server_info` (`kv_events`: host, base port + rank, topic, replay port).

Alerts and dashboards: every rule over these `kvcache_*` series holds for an SGLang target (same
names); the dashboards' `Engine kind` variable selects one engine. The two latency SLO alerts
(TimeToFirstToken, PrefillLatency) read vLLM's own histograms and stay silent for SGLang: SGLang's
time-to-first-token buckets (..., 1, 2, 4, ...) have no 2.5 s boundary to count against, and it has
no prefill-time histogram; `kvcache_time_to_first_token_seconds{engine_kind="sglang"}` has its quantiles.

What SGLang's /metrics cannot support is absent for an SGLang target, never 0:

| metric | why absent |
|---|---|"""


def flag_table(command: str) -> tuple[config.Option, ...]:
    """Read when asked, so a registered source's options (kit.py) are in serve's table."""
    return config.OPTIONS if command == "serve" else config.AGGREGATE_OPTIONS


FLAGS_HEAD = "| flag | environment | YAML key | default | |\n|---|---|---|---|---|"


def flags_markdown(command: str) -> str:
    """Every option of `command`, as `--help` says it: flag, env twin, YAML key, default, meaning."""
    rows = [FLAGS_HEAD]
    for o in flag_table(command):
        repeat = " (repeatable)" if o.multiple else ""
        default = config.default_text(o)
        cells = (
            f"`{o.flag}`{repeat}",
            f"`{o.env}`",
            f"`{o.key}`",
            "—" if default == "unset" else f"`{default}`",
            o.help,
        )
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def with_flag_tables(text: str) -> str:
    """`text` (README.md) with each `<!-- flags:COMMAND -->` ... `<!-- /flags -->` block rewritten."""

    def table(match: re.Match[str]) -> str:
        return f"{match.group(1)}\n{flags_markdown(match.group(2))}\n{match.group(3)}"

    return re.sub(r"(<!-- flags:(\w+) -->)\n.*?\n?(<!-- /flags -->)", table, text, flags=re.S)
