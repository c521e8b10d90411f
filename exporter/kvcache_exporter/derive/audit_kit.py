"""What the configuration audit (derive/audit.py) declares beside its code: its catalog entry, its
option and its setting. catalog.py and config.py concatenate them in their place; server.ROWS runs
it."""

from __future__ import annotations

from dataclasses import dataclass

from ..metric import entry
from ..options import Option, ratio

CONFIG_CHECK = "kvcache_config_check"

METRICS = (
    entry(
        CONFIG_CHECK,
        "gauge",
        "Result of a configuration check: 1 pass, 0 fail (the list: docs/gpu-cost.md, Config checks).",
        ("model_name", "check"),
        "",
        "config",
        "vllm:cache_config_info, observed concurrency and tokens, GPU memory, KV events, metric schema",
        per_target=False,  # one result per model, over every target
    ),
)

OPTIONS = (
    Option(
        "audit.gpu_memory_utilization_ceiling",
        ratio,
        0.9,
        "highest gpu_memory_utilization that passes the audit on a GPU shared with other processes",
    ),
)


@dataclass(frozen=True)
class AuditSettings:
    """One field per option above (config.resolve fills them; Settings has them)."""

    audit_gpu_memory_utilization_ceiling: float
