"""The KV cache's shape from a capture of vLLM's /metrics (`vllm:cache_config_info`) or SGLang's
(`sglang:page_size`, `sglang:num_pages`, `sglang:max_total_num_tokens`), or what is assumed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..derive.cache_config import config_number
from ..derive.whatif import host_tier_blocks, kv_bytes_per_token
from ..sources.base import SourceError
from ..sources.sglang_parse import is_sglang
from ..sources.sglang_parse import parse as parse_sglang
from ..sources.textformat import parse_line
from .lines import json_object, read_lines

INFO = "vllm:cache_config_info"
DEFAULT_BLOCK_SIZE = 16
DEFAULT_NUM_GPU_BLOCKS = 2048
HOW_TO_FIND = (
    "read it from the server: `curl -s HOST:PORT/metrics | grep cache_config_info` (labels num_gpu_blocks, "
    "block_size), or vLLM's start-up log line `GPU KV cache size: N tokens` divided by the block size; "
    "or pass that capture with --metrics FILE"
)


@dataclass
class CacheShape:
    block_size: int
    """tokens per KV block as the replay counts hits: the hit unit"""
    num_gpu_blocks: int
    """blocks of `block_size` tokens per replica"""
    notes: list[str]
    """where each value came from, what was assumed"""


def read_capture(path: str | Path) -> list[dict[str, str]]:
    """The cache_config_info labels of each engine in a capture: exposition text, or JSON lines of
    snapshots (`{"text": <exposition>}` each, as ../shared's fixtures record them: the last one counts)."""
    engines: list[dict[str, str]] = []
    with open(path, "rb") as stream:
        for number, line in read_lines(stream):
            if isinstance(line, ValueError):
                continue
            if line.startswith("{"):
                snapshot = json_object(line).get("text")
                if isinstance(snapshot, str):
                    found = _engines(snapshot.splitlines(), f"{path}:{number}") or _sglang(snapshot, path)
                    engines = found or engines
            elif line.startswith(INFO):
                engines += _engines([line], f"{path}:{number}")
    if not engines:
        engines = _sglang(Path(path).read_text(errors="replace"), path)
    if not engines:
        raise ValueError(f"{path}: no {INFO} sample (a capture of vLLM's or SGLang's /metrics is expected)")
    return engines


def _sglang(text: str, where: str | Path) -> list[dict[str, str]]:
    """An SGLang page's capacity gauges as cache_config_info labels (one engine), else nothing."""
    if not is_sglang(text):
        return []
    try:
        return list(parse_sglang(text).cache_configs.values())
    except SourceError as err:
        raise ValueError(f"{where}: {err}") from None


def _engines(lines: list[str], where: str) -> list[dict[str, str]]:
    out = []
    for line in lines:
        if line.startswith(INFO):
            try:
                sample = parse_line(line.rstrip("\n"))
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            if sample.name == INFO:
                out.append(sample.labels)
    return out


def cache_shape(block_size: int | None, num_gpu_blocks: int | None, capture: str | None) -> CacheShape:
    """The flags win; else the capture (its hit unit: effective_attention_block_size where vLLM reports
    one, the block count rescaled to it); else the defaults, said plainly."""
    notes: list[str] = []
    unit = blocks = None
    if capture is not None:
        engines = read_capture(capture)
        config = engines[0]
        size = _positive(config, "block_size")
        unit = _positive(config, "effective_attention_block_size") or size
        blocks = _positive(config, "num_gpu_blocks")
        if blocks is not None and size is not None and unit is not None:
            blocks = blocks * size // unit
        if len(engines) > 1:
            notes.append(f"{capture} has {len(engines)} engines (data-parallel ranks): use --replicas")
        if unit is not None and size is not None and unit != size:
            notes.append(
                f"hit unit {unit} tokens (effective_attention_block_size; block_size {size}): blocks counted "
                f"in units of {unit}"
            )
        notes.append(f"from {capture}: hit unit {unit} tokens, {blocks} blocks per replica")
    if block_size is None and unit is None:
        notes.append(f"assumed --block-size {DEFAULT_BLOCK_SIZE} (vLLM's default on GPUs): {HOW_TO_FIND}")
    if num_gpu_blocks is None and blocks is None:
        notes.append(
            f"assumed --num-gpu-blocks {DEFAULT_NUM_GPU_BLOCKS}: the capacity findings depend on it; "
            f"{HOW_TO_FIND}"
        )
    return CacheShape(
        block_size or unit or DEFAULT_BLOCK_SIZE, num_gpu_blocks or blocks or DEFAULT_NUM_GPU_BLOCKS, notes
    )


def _positive(config: dict[str, str], key: str) -> int | None:
    value = config_number(config, key)
    return int(value) if value is not None and value >= 1 and value == int(value) else None


def host_tier(
    blocks: int | None, size_bytes: int | None, capture: str | None, block_size: int
) -> tuple[int, float | None] | None:
    """(host tier blocks of `block_size` tokens, KV bytes per token or None) from --host-tier-blocks, or
    --host-tier-bytes over the capture's KV layout, or the tier the capture reports; None for no tier."""
    if min(blocks or 0, size_bytes or 0) < 0:
        raise ValueError("--host-tier-blocks and --host-tier-bytes must be >= 0")
    config = read_capture(capture)[0] if capture is not None else None
    per_token = kv_bytes_per_token(config)
    if blocks is not None:
        return blocks, per_token
    if size_bytes is not None and per_token is None:
        raise ValueError(
            "--host-tier-bytes needs the bytes of a KV block: pass --metrics with a capture whose "
            "cache_config_info has kv_cache_memory_bytes and kv_cache_size_tokens, or use --host-tier-blocks"
        )
    if config is None or per_token is None:
        return None
    reported = host_tier_blocks(config, size_bytes)  # in blocks of vLLM's block_size
    size = _positive(config, "block_size")
    if reported is None or size is None:
        return None
    return reported * size // block_size, per_token
