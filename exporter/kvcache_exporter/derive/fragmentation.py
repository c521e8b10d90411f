"""An ESTIMATE of KV-cache slots allocated but holding no token (internal fragmentation).

vLLM allocates KV memory in blocks of block_size tokens; a running sequence's last block is
partly empty. Under uniformly distributed sequence lengths the unfilled tail averages
(block_size - 1) / 2 slots per running sequence. No vLLM metric exposes this directly.
"""

from __future__ import annotations


def fragmentation_estimate_ratio(
    block_size: float | None,
    blocks_in_use: float | None,
    running_requests: float | None,
    tokens_in_use: float | None = None,
) -> float | None:
    """Empty slots over slots in use (blocks_in_use x block_size), capped to [0, 1].

    With tokens_in_use (exact tokens held by running sequences) the result is exact:
    (slots - tokens) / slots. Otherwise: running x (block_size - 1) / 2 / slots.
    None when nothing is in use or an input is missing.
    """
    if block_size is None or blocks_in_use is None or block_size <= 0:
        return None
    slots = blocks_in_use * block_size
    if slots <= 0:
        return None
    if tokens_in_use is not None:
        empty = slots - tokens_in_use
    elif running_requests is not None:
        empty = running_requests * (block_size - 1) / 2
    else:
        return None
    return min(max(empty / slots, 0.0), 1.0)
