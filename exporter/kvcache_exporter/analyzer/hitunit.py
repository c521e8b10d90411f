"""What the hit unit costs: the hit ratio with no eviction at several block sizes (hit units). Pure.

vLLM hits whole blocks only, so shared content short of a whole unit is recomputed; a coarser unit
(DeepSeek-V4 hits in 256-token units) loses more of each shared prefix. With no eviction a request hits
the longest prefix (in tokens, at the finest unit) it shares with an earlier request on its replica, cut
to whole units of u and to the (prompt - 1) // u units vLLM may hit: one pass over the chains gives every
unit that is a multiple of the finest (the unit's own cost, apart from capacity)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .blocktrace import BlockRequest, Interner, from_tokens
from .mrc import restart_points, route_blocks
from .trace import TraceRequest

UNITS = (16, 32, 64, 128, 256)


def shared_prefix_tokens(
    requests: Sequence[BlockRequest],
    group_tokens: Callable[[BlockRequest], list[int]],
    replicas: int,
    routing: str,
) -> list[int]:
    """Per request, the tokens of its leading groups seen on its replica since the last restart (each
    group up to the most of it any earlier request held)."""
    widest: list[dict[int, int]] = [{} for _ in range(replicas)]
    restarts, out = restart_points(requests), []
    for n, (r, replica) in enumerate(zip(requests, route_blocks(requests, replicas, routing), strict=True)):
        if n in restarts:
            widest = [{} for _ in range(replicas)]
        seen, shared, sizes = widest[replica], 0, group_tokens(r)
        for group, tokens in zip(r.groups, sizes, strict=True):
            held = seen.get(group, 0)
            shared += min(held, tokens)
            if held < tokens:
                break
        out.append(shared)
        for group, tokens in zip(r.groups, sizes, strict=True):
            if seen.get(group, 0) < tokens:
                seen[group] = tokens
    return out


def unit_rows(
    requests: Sequence[BlockRequest],
    traces: Sequence[TraceRequest],
    block_size: int,
    trace_block: int | None,
    replicas: int = 1,
    routing: str = "round-robin",
) -> list[dict]:
    """Hit ratio with no eviction at UNITS and `block_size`: a token trace's chains at the finest unit,
    a hash trace at the units dividing its trace block."""
    units = sorted({*UNITS, block_size})
    if trace_block is None:
        base = math.gcd(*units)
        if base != block_size:
            ids = Interner()
            requests = [from_tokens(t, base, ids) for t in traces]
        shared = shared_prefix_tokens(requests, lambda r: [base] * len(r.groups), replicas, routing)
    else:
        units = [u for u in units if trace_block % u == 0]

        def sizes(r: BlockRequest) -> list[int]:
            last = r.prompt_tokens - (len(r.groups) - 1) * trace_block
            return [trace_block] * (len(r.groups) - 1) + [last]

        shared = shared_prefix_tokens(requests, sizes, replicas, routing)
    prompt_tokens = sum(r.prompt_tokens for r in requests) or 1
    rows = []
    for unit in units:
        hit = sum(
            min(s // unit, (r.prompt_tokens - 1) // unit) * unit
            for s, r in zip(shared, requests, strict=True)
        )
        rows.append({"unit": unit, "unbounded_hit_ratio": round(hit / prompt_tokens, 6), "hit_tokens": hit})
    best = max((row["hit_tokens"] for row in rows), default=0)
    for row in rows:
        row["lost_tokens"] = best - row["hit_tokens"]
    return rows
