"""vLLM's `--kv-cache-metrics` block residency sampling (after `vllm/v1/core/kv_cache_metrics.py`).

A sampled fraction of allocated blocks (vLLM's `--kv-cache-metrics-sample`, default 0.01) is followed
from allocation to eviction on the simulator's clock: lifetime = allocation to eviction, idle = last
access to eviction, reuse gaps = differences of the last four accesses (vLLM's ring buffer of 4).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass, field

from .stats import Histogram

RESIDENCY_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0,
)  # fmt: skip
RESIDENCY_HISTOGRAMS = (
    "kv_block_lifetime_seconds",
    "kv_block_idle_before_evict_seconds",
    "kv_block_reuse_gap_seconds",
)
ACCESS_HISTORY = 4
DEFAULT_SAMPLE = 0.01


@dataclass
class _Tracked:
    birth: float
    last_access: float
    accesses: deque[float] = field(default_factory=lambda: deque(maxlen=ACCESS_HISTORY))


class Residency:
    def __init__(self, histograms: dict[str, Histogram], sample_rate: float, seed: int = 0) -> None:
        if not 0 < sample_rate <= 1:
            raise ValueError(f"kv-cache-metrics sample must be in (0, 1], got {sample_rate}")
        self._sample_rate = sample_rate
        self._random = random.Random(seed)
        self._tracked: dict[int, _Tracked] = {}
        self._histograms = histograms
        for name in RESIDENCY_HISTOGRAMS:
            histograms[name] = Histogram(RESIDENCY_BUCKETS)

    def allocated(self, block_id: int, now: float) -> None:
        if self._random.random() < self._sample_rate:
            self._tracked[block_id] = _Tracked(now, now)

    def accessed(self, block_id: int, now: float) -> None:
        tracked = self._tracked.get(block_id)
        if tracked is not None:
            tracked.last_access = now
            tracked.accesses.append(now)

    def evicted(self, block_id: int, now: float) -> None:
        tracked = self._tracked.pop(block_id, None)
        if tracked is None:
            return
        self._histograms["kv_block_lifetime_seconds"].observe(now - tracked.birth)
        self._histograms["kv_block_idle_before_evict_seconds"].observe(now - tracked.last_access)
        for earlier, later in itertools.pairwise(tracked.accesses):
            self._histograms["kv_block_reuse_gap_seconds"].observe(later - earlier)

    def reset(self) -> None:
        self._tracked.clear()
