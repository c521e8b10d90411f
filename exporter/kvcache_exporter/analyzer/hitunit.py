"""What the hit unit costs: the hit ratio with no eviction at several block sizes (hit units). Pure.

vLLM hits whole blocks only, so shared content short of a whole unit is recomputed; a coarser unit
(DeepSeek-V4 hits in 256-token units) loses more of each shared prefix. One pass per unit over the
trace's chains (no eviction: the unit's own cost, apart from capacity)."""

from __future__ import annotations

from collections.abc import Sequence

from .blocktrace import BlockRequest, Interner, from_tokens
from .mrc import restart_points, route_blocks
from .trace import TraceRequest

UNITS = (16, 32, 64, 128, 256)


def unbounded_hit_tokens(requests: Sequence[BlockRequest], unit: int, replicas: int, routing: str) -> int:
    """Hit tokens with no eviction: each request hits its leading groups up to their widest earlier use on
    its replica since the last restart (the mrc's `unbounded`)."""
    widest: list[dict[int, int]] = [{} for _ in range(replicas)]
    restarts, hits = restart_points(requests), 0
    for n, (r, replica) in enumerate(zip(requests, route_blocks(requests, replicas, routing), strict=True)):
        if n in restarts:
            widest = [{} for _ in range(replicas)]
        seen, hittable, index = widest[replica], (r.prompt_tokens - 1) // unit, 0
        for group, width in zip(r.groups, r.widths, strict=True):
            eligible = min(width, hittable - index)
            if eligible <= 0:
                break
            k = min(seen.get(group, 0), eligible)
            hits += k
            if k < eligible:
                break
            index += width
        for group, width in zip(r.groups, r.widths, strict=True):
            if seen.get(group, 0) < width:
                seen[group] = width
    return hits * unit


def _rescaled(r: BlockRequest, trace_block: int, unit: int) -> BlockRequest:
    widths = [trace_block // unit] * len(r.groups)
    widths[-1] = (r.prompt_tokens - (len(r.groups) - 1) * trace_block) // unit
    return BlockRequest(r.groups, widths, r.prompt_tokens, r.max_tokens, r.session, r.timestamp, r.instance)


def unit_rows(
    requests: Sequence[BlockRequest],
    traces: Sequence[TraceRequest],
    block_size: int,
    trace_block: int | None,
    replicas: int = 1,
    routing: str = "round-robin",
) -> list[dict]:
    """Hit ratio with no eviction at UNITS and `block_size`: token traces rechunked at each unit, hash
    traces at the units dividing their trace block."""
    prompt_tokens = sum(r.prompt_tokens for r in requests) or 1
    rows = []
    for unit in sorted({*UNITS, block_size}):
        if trace_block is None:
            ids = Interner()
            chains = [from_tokens(t, unit, ids) for t in traces]
        elif trace_block % unit == 0:
            chains = [_rescaled(r, trace_block, unit) for r in requests]
        else:
            continue
        hit = unbounded_hit_tokens(chains, unit, replicas, routing)
        rows.append({"unit": unit, "unbounded_hit_ratio": round(hit / prompt_tokens, 6), "hit_tokens": hit})
    best = max((row["hit_tokens"] for row in rows), default=0)
    for row in rows:
        row["lost_tokens"] = best - row["hit_tokens"]
    return rows
