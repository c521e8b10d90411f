"""Everything a simulator instance is configured with, and the `cache_config_info` labels it implies."""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import EngineConfig
from .layouts import layout_named


@dataclass
class Faults:
    metrics_delay_s: float = 0.0
    metrics_fail: bool = False
    metrics_malformed: bool = False
    drop_kv_seq_every: int = 0
    """Skip a KV-event sequence number every N batches (0: never)."""


@dataclass
class SimulatorConfig:
    host: str = "127.0.0.1"
    port: int = 0
    model_name: str = "sim-llama"
    engine: EngineConfig = field(default_factory=EngineConfig)
    engines: int = 1
    routing: str = "round-robin"
    """`round-robin` or `session` (hash of the request's `user`/session onto an engine)."""
    metrics_schema: str = "v1"
    schedule: str = "normalized"
    """Workloads over time, e.g. `normalized:60s,raw:60s,normalized:60s`; `none` serves API traffic only."""
    rate: float = 5.0
    concurrency: int = 32
    speed: float = 1.0
    seed: int = 20251202
    trace_path: str | None = None
    tokenizer_path: str | None = None  # the raw/normalized header as real text in this tokenizer
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = "kv"
    kv_buffer_steps: int = 10000
    kv_bytes_per_token: int = 131072
    gpu_memory_utilization: float = 0.9
    gpu_memory_total_mib: int = 81559
    memory_swing_period_s: float = 0.0
    """If >0, GPU used memory swings between 12 GB and 20 GB with this period (the seed incident)."""
    api_server_count: int = 1
    """Above 1, /metrics is prometheus_client's multiprocess view: no `_created` samples (as vLLM's)."""
    lora_adapters: tuple[str, ...] = ()
    """LoRA adapters served beside the base model; built-in traffic spreads its sessions over all of them."""
    session_ids: bool = False
    """Built-in traffic sends its session as vLLM's `session_id` (it appears on BlockStored)."""
    kv_cache_report_mode: str = "default"
    """`full`: built-in requests ask vLLM to re-announce the blocks their prefix hits reused."""
    faults: Faults = field(default_factory=Faults)


def cache_config_labels(config: SimulatorConfig, engine_index: int) -> dict[str, str]:
    """Every label vLLM 0.32 prints on `vllm:cache_config_info`, values as `str()` renders them."""
    ec = config.engine
    tokens = ec.num_gpu_blocks * ec.block_size
    layout = layout_named(ec.layout)
    labels = {
        "_block_size_resolved": "True",
        "block_size": str(ec.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(ec.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(ec.enable_prefix_caching),
        "engine": str(engine_index),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(tokens / ec.max_model_len),
        "kv_cache_memory_bytes": str(tokens * config.kv_bytes_per_token),
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(ec.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }
    if ec.offload_cpu_blocks:  # vLLM's --kv-offloading-size is in GiB
        labels["kv_offloading_size"] = str(ec.offload_cpu_blocks * ec.offload_block_bytes / 2**30)
    if layout is not None:
        labels.update(layout.cache_config)
        labels["user_specified_block_size"] = "False"
    return labels
