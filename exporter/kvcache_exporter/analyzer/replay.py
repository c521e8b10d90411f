"""Replay a trace through the simulator's engine (vLLM V1 scheduler over its block pool)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..routing import route_all
from ..simulator.engine import Engine, EngineConfig, KeyedRequest, Request
from .blocktrace import BlockRequest, fresh_keys, prompt_keys
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
    return route_all((r.session for r in requests), replicas, routing)


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
        kv_events=False,
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


def concurrent_replay(
    requests: Sequence[TraceRequest] | Sequence[BlockRequest],
    block_size: int,
    num_gpu_blocks: int,
    replicas: int = 1,
    routing: str = "round-robin",
    max_model_len: int | None = None,
    concurrency: int | None = None,
    speed: float | None = None,
    restarts: frozenset[int] = frozenset(),
) -> Replay:
    """Requests overlap: `concurrency` clients in a closed loop (each sends its next request when its last
    one finished), or (`speed`) an open loop at the trace's timestamps, gaps divided by `speed`. Every
    replica runs the engine's scheduler on one virtual clock, so queueing, batching and preemptions happen.
    Token-id requests (TraceRequest) or block-hash ones (BlockRequest: replayed as their chains of block
    keys, built when a request arrives and dropped when it finishes). `restarts`: request positions whose
    arrival waits for the requests in flight to finish (a drain), then every replica starts empty."""
    bad = (concurrency is not None and concurrency < 1) or (speed is not None and speed <= 0)
    if (concurrency is None) == (speed is None) or bad:
        raise ValueError("give one of concurrency >= 1 or speed > 0")
    config = _config(requests, block_size, num_gpu_blocks, max_model_len)
    engines = [Engine(config, i) for i in range(replicas)]
    clocks = [0.0] * replicas
    targets = route(requests, replicas, routing)
    pending = _arrivals(requests, concurrency, speed)
    hits, fresh = [0] * len(requests), fresh_keys()
    rejected, prompt_tokens, cursor, preempted = 0, 0, len(pending), 0
    while pending or any(e.has_work for e in engines):
        busy = [i for i, e in enumerate(engines) if e.has_work]
        step_at = min((clocks[i] for i in busy), default=float("inf"))
        if pending and pending[0][0] <= step_at and not (busy and pending[0][1] in restarts):
            arrival, n = heapq.heappop(pending)
            if n in restarts:
                preempted += sum(e.stats.num_preemptions for e in engines)
                engines = [Engine(config, i) for i in range(replicas)]
            replica = targets[n]
            clocks[replica] = max(clocks[replica], arrival)
            try:
                engines[replica].add_request(_engine_request(requests[n], n, arrival, fresh))
                prompt_tokens += _prompt_len(requests[n])
            except ValueError:
                rejected += 1
                cursor = _next_client(requests, pending, cursor, arrival, concurrency)
            continue
        replica = min(busy, key=lambda i: clocks[i])
        result = engines[replica].step(clocks[replica])
        clocks[replica] += max(result.duration, 1e-6)
        for done in result.finished:
            hits[int(done.request_id)] = max(done.num_cached_tokens, 0)
            cursor = _next_client(requests, pending, cursor, clocks[replica], concurrency)
    return Replay(
        sum(hits) / prompt_tokens if prompt_tokens else 0.0,
        prompt_tokens,
        sum(hits),
        len(requests),
        rejected,
        preempted + sum(e.stats.num_preemptions for e in engines),
        hits,
    )


def _prompt_len(r: TraceRequest | BlockRequest) -> int:
    return r.prompt_tokens if isinstance(r, BlockRequest) else len(r.prompt_token_ids)


def _engine_request(r: TraceRequest | BlockRequest, n: int, arrival: float, fresh) -> Request:
    if isinstance(r, BlockRequest):
        keys = prompt_keys(r)
        return KeyedRequest(
            str(n),
            [],
            r.max_tokens,
            arrival,
            None,
            prompt_keys=keys,
            prompt_len=r.prompt_tokens,
            fresh_keys=fresh,
        )
    return Request(str(n), list(r.prompt_token_ids), r.max_tokens, arrival, forced_output=r.forced_output)


def _config(requests, block_size, num_gpu_blocks, max_model_len) -> EngineConfig:
    longest = max((_prompt_len(r) + r.max_tokens for r in requests), default=1)
    return EngineConfig(
        block_size=block_size,
        num_gpu_blocks=num_gpu_blocks,
        max_model_len=max(max_model_len or 0, longest),
        max_num_batched_tokens=max(8192, longest),
        kv_events=False,
    )


def _arrivals(requests, concurrency, speed) -> list[tuple[float, int]]:
    if concurrency is not None:
        return [(0.0, n) for n in range(min(concurrency, len(requests)))]
    stamps = [r.timestamp if isinstance(r, BlockRequest) else r.send_ts for r in requests]
    first = next((t for t in stamps if t is not None), 0.0)
    times, last = [], 0.0
    for t in stamps:
        last = max(last, (t - first) / speed) if t is not None else last
        times.append((last, len(times)))
    heapq.heapify(times)
    return times


def _next_client(requests, pending, cursor, now, concurrency) -> int:
    """Closed loop: a client that got its answer sends the next request of the trace."""
    if concurrency is not None and cursor < len(requests):
        heapq.heappush(pending, (now, cursor))
        return cursor + 1
    return cursor
