"""How long one scheduler step takes: a linear model, tuned to look like a mid-size model on one GPU."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    base_s: float = 0.012
    """Fixed cost of a forward pass (kernel launches, sampling, scheduling)."""
    per_prefill_token_s: float = 0.00006
    """Per prompt token actually computed (cache hits cost nothing): ~16k tokens/s of prefill."""
    per_decode_seq_s: float = 0.0003
    """Per sequence decoding one token in the step."""

    def step_seconds(self, prefill_tokens: int, decode_seqs: int) -> float:
        return self.base_s + prefill_tokens * self.per_prefill_token_s + decode_seqs * self.per_decode_seq_s
