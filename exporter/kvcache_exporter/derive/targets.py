"""The samples of one vLLM target: up, its metric schema, and every engine's current and windowed values."""

from __future__ import annotations

import functools
from collections.abc import Sequence

from .. import catalog as c
from ..durations import window_label
from ..samples import Sample
from . import cache, offload
from .state import TargetState


def target_samples(
    target: TargetState, windows: Sequence[float], quantiles: tuple[float, ...]
) -> list[Sample]:
    base = target.labels
    if target.engine_kind != "vllm":  # vLLM's series keep the labels they always had
        base = {**base, "engine_kind": target.engine_kind}
    out = [Sample(c.VLLM_UP, base, float(target.up))]
    snapshot = target.snapshot
    if not target.up or snapshot is None:
        return out  # no stale numbers: derived series vanish while vLLM is unreachable
    out += [
        Sample(c.VLLM_SCHEMA_INFO, {**base, "schema": snapshot.schema, "prefix": snapshot.prefix}, 1.0),
        Sample(c.VLLM_DEPRECATED_METRICS, base, float(len(snapshot.deprecated))),
        Sample(c.VLLM_MISSING_METRICS, base, float(len(snapshot.missing))),
    ]
    labelled = _labelled(tuple(windows))
    for (model, engine), sample in snapshot.engines.items():
        labels = {**base, "model_name": model, "engine": engine}
        out += cache.current(labels, sample, snapshot.cache_configs.get(engine))
        out += offload.current(labels, sample)
        history = target.histories.get((model, engine))
        for seconds, window in labelled if history else ():
            delta = history.window(seconds)
            if delta is not None:
                out += cache.windowed(labels, window, delta, quantiles)
                out += offload.windowed(labels, window, delta)
    return out


@functools.lru_cache(maxsize=16)  # one set of windows per exporter: labels written once, not per target
def _labelled(windows: tuple[float, ...]) -> tuple[tuple[float, str], ...]:
    return tuple((seconds, window_label(seconds)) for seconds in windows)
