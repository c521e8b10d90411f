"""How long one scheduler step takes: a linear model, calibrated to a large model's prefill speed.

A 70B-class model on one H100/H200 (FP8) prefills about 2,500 tokens/s: computed prompt tokens cost
what they cost on a real GPU, so a phase whose prompts miss the cache (the seed's raw layout, ~256
computed tokens per request) shows a prefill and TTFT p99 several times that of a phase whose
prompts hit (~40 computed tokens). The seed run saw prefill p99 rise from 120 to 380 ms."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    base_s: float = 0.015
    """Fixed cost of a forward pass (kernel launches, sampling, scheduling)."""
    per_prefill_token_s: float = 0.0004
    """Per prompt token actually computed (cache hits cost nothing): 2,500 tokens/s of prefill."""
    per_decode_seq_s: float = 0.0005
    """Per sequence decoding one token in the step."""

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + prefill_tokens * self.per_prefill_token_s + decode_seqs * self.per_decode_seq_s
