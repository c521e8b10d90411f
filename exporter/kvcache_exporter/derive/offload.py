"""KV offloading from vLLM's /metrics (0.33's offloading connector and multi-tier families). Pure.

Read from the released wheel's source (`vllm/distributed/kv_transfer/kv_connector/v1/offloading/
metrics.py`, `vllm/v1/kv_offload/cpu/`, `vllm/v1/kv_offload/tiering/base.py`): loads (offload tier
-> GPU) and stores (GPU -> tier) in bytes and seconds, store allocation failures, stores skipped.
Host-tier hits come from `prompt_tokens_cached_by_source{source="host"}`. A tier that stores and
never loads back costs transfer time and memory and earns nothing: `stores_without_loads`.
"""

from __future__ import annotations

from .. import catalog as c
from ..samples import Sample
from ..sources.vllm_snapshot import EngineSample
from .windows import Delta

TOTALS = {
    c.OFFLOAD_ALLOCATION_FAILURES_TOTAL: "offload_allocation_failures",
    c.OFFLOAD_STORES_SKIPPED_TOTAL: "offload_stores_skipped",
}
RATES = {
    ("load", "bytes"): "offload_load_bytes",
    ("store", "bytes"): "offload_store_bytes",
    ("load", "seconds"): "offload_load_seconds",
    ("store", "seconds"): "offload_store_seconds",
}


def current(labels: dict[str, str], sample: EngineSample) -> list[Sample]:
    counters = sample.counters
    return [Sample(name, labels, counters[key]) for name, key in TOTALS.items() if key in counters]


def windowed(labels: dict[str, str], window: str, delta: Delta) -> list[Sample]:
    """Transfer rates, the host tier's hit ratio and stores-without-loads over one window; nothing
    where vLLM exports no offload family."""
    counters = delta.counters
    if not any(key in counters for key in RATES.values()):
        return []
    labels = {**labels, "window": window}
    out = []
    for (direction, unit), key in RATES.items():
        if key in counters and delta.seconds > 0:
            name = c.OFFLOAD_BYTES_PER_SECOND if unit == "bytes" else c.OFFLOAD_BUSY_RATIO
            value = counters[key] / delta.seconds
            out.append(
                Sample(
                    name, {**labels, "direction": direction}, min(value, 1.0) if unit == "seconds" else value
                )
            )
    queries, host = counters.get("query_tokens"), counters.get("cached_tier_host")
    if queries and host is not None:
        out.append(Sample(c.OFFLOAD_HOST_HIT_RATIO, labels, min(max(host / queries, 0.0), 1.0)))
    stored, loaded = counters.get("offload_store_bytes"), counters.get("offload_load_bytes")
    if stored is not None and loaded is not None:
        out.append(Sample(c.OFFLOAD_STORES_WITHOUT_LOADS, labels, float(stored > 0 and loaded == 0)))
    return out
