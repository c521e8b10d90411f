"""Exporters the benchmarks drive: vLLM targets only, wired as `serve` wires them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from ..collector import Exporter, target_polls
from ..derive.registry import DeriveOptions
from ..derive.state import PollState
from ..sources.base import Source


def vllm_exporter(
    sources: dict[str, Source[Any]],
    *,
    windows: Sequence[float],
    quantiles: Sequence[float],
    interval: float,
    clock: Callable[[], float] = time.time,
) -> Exporter:
    """An exporter of vLLM targets only (name -> source), as benchmarks and tests drive it."""
    state = PollState(retention=max(windows) + 2 * interval)
    options = DeriveOptions(windows=tuple(sorted(windows)), quantiles=tuple(quantiles))
    return Exporter(target_polls(state, sources), state, options, interval=interval, clock=clock)
