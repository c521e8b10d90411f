"""Replay a trace through the simulator's engine (vLLM V1 scheduler over its block pool)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..simulator.engine import Engine, EngineConfig, Request
from .trace import TraceRequest


@dataclass
class Replay:
    hit_ratio: float
    prompt_tokens: int
    hit_tokens: int
    requests: int
    rejected: int
    """requests that can never fit the pool (or max_model_len) and were skipped"""
    preemptions: int
    per_request_hits: list[int] = field(repr=False, default_factory=list)


def route(requests: Sequence[TraceRequest], replicas: int, routing: str) -> list[int]:
    """The replica of each request, as the simulator's API server routes (round-robin or CRC32 of session)."""
    out, rr = [], 0
    for r in requests:
        if routing == "session" and r.session:
            out.append(zlib.crc32(r.session.encode()) % replicas)
        else:
            out.append(rr % replicas)
            rr += 1
    return out


def blocks_needed_unbounded(requests: Sequence[TraceRequest], block_size: int) -> int:
    """A pool no request ever has to evict from: every token of the trace in its own block, plus slack."""
    return sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in requests) + 2


def replay(
    requests: Sequence[TraceRequest],
    block_size: int,
    num_gpu_blocks: int,
    replicas: int = 1,
    routing: str = "round-robin",
    max_model_len: int | None = None,
    restarts: frozenset[int] = frozenset(),
) -> Replay:
    """`restarts`: request positions before which every replica restarts with an empty cache."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    longest = max((len(r.prompt_token_ids) + r.max_tokens for r in requests), default=1)
    config = EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max(max_model_len or 0, longest),
        max_num_batched_tokens=max(8192, longest),
    )
    engines = [Engine(config, i) for i in range(replicas)]
    clocks = [0.0] * replicas
    hits, prompt_tokens, rejected = [], 0, 0
    preempted = 0
    for n, (request, replica) in enumerate(zip(requests, route(requests, replicas, routing), strict=True)):
        if n in restarts:
            preempted += sum(e.stats.num_preemptions for e in engines)
            engines = [Engine(config, i) for i in range(replicas)]
        engine = engines[replica]
        sim = Request(
            str(request.index),
            list(request.prompt_token_ids),
            request.max_tokens,
            clocks[replica],
            forced_output=request.forced_output,
        )
        try:
            engine.add_request(sim)
        except ValueError:
            rejected += 1
            hits.append(0)
            continue
        while engine.has_work:
            clocks[replica] += engine.step(clocks[replica]).duration
        hits.append(max(sim.num_cached_tokens, 0))
        prompt_tokens += len(request.prompt_token_ids)
    total_hits = sum(hits)
    return Replay(
        total_hits / prompt_tokens if prompt_tokens else 0.0,
        prompt_tokens,
        total_hits,
        len(requests),
        rejected,
        preempted + sum(e.stats.num_preemptions for e in engines),
        hits,
    )
