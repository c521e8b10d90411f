"""The numbers one engine reports: counters, gauges and histograms with vLLM 0.32's bucket boundaries."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_TIME_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def one_two_five(limit: int) -> tuple[int, ...]:
    """vLLM's `build_1_2_5_buckets`: 1, 2, 5, 10, 20, 50, ... up to `limit`."""
    buckets, exponent = [], 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip([*self.buckets, float("inf")], self.counts, strict=True):
            running += count
            out.append((_le(bound), running))
        return out


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
LATENCY_HISTOGRAMS = {
    "time_to_first_token_seconds": TTFT_BUCKETS,
    "inter_token_latency_seconds": ITL_BUCKETS,
    "request_time_per_output_token_seconds": ITL_BUCKETS,
    "e2e_request_latency_seconds": REQUEST_TIME_BUCKETS,
    "request_queue_time_seconds": REQUEST_TIME_BUCKETS,
    "request_inference_time_seconds": REQUEST_TIME_BUCKETS,
    "request_prefill_time_seconds": REQUEST_TIME_BUCKETS,
    "request_decode_time_seconds": REQUEST_TIME_BUCKETS,
}
TOKEN_HISTOGRAMS = (
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_max_num_generation_tokens",
    "request_params_max_tokens",
    "request_prefill_kv_computed_tokens",
)


@dataclass
class EngineStats:
    max_model_len: int
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    prompt_tokens_external: int = 0
    """Of the cached ones, those loaded from the offload tier."""
    generation_tokens: int = 0
    num_preemptions: int = 0
    request_success: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISHED_REASONS, 0))
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def __post_init__(self) -> None:
        token_buckets = one_two_five(self.max_model_len)
        for name, buckets in LATENCY_HISTOGRAMS.items():
            self.histograms[name] = Histogram(buckets)
        for name in TOKEN_HISTOGRAMS:
            self.histograms[name] = Histogram(token_buckets)
        self.histograms["iteration_tokens_total"] = Histogram(ITERATION_TOKEN_BUCKETS)
        self.histograms["request_params_n"] = Histogram(PARAMS_N_BUCKETS)
        self.histograms["request_num_preemptions"] = Histogram(PREEMPTION_BUCKETS)

    def observe(self, name: str, value: float) -> None:
        self.histograms[name].observe(value)
