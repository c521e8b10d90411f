"""What one poll of a vLLM server yields, normalized: per (model_name, engine) counters, gauges and
histograms, whatever naming generation the server uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple


class Histogram(NamedTuple):  # a tuple, not a frozen dataclass: a poll makes dozens per engine
    bounds: tuple[float, ...]  # upper bounds, ascending, ending with +Inf
    counts: tuple[float, ...]  # cumulative counts per bound
    sum: float

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0


@dataclass
class EngineSample:
    counters: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    start_time: float | None = None  # changes when vLLM restarts


EngineKey = tuple[str, str]  # (model_name, engine)


@dataclass
class VllmSnapshot:
    engines: dict[EngineKey, EngineSample]
    cache_configs: dict[str, dict[str, str]]  # engine -> cache_config_info labels
    schema: str
    prefix: str
    deprecated: tuple[str, ...]
    missing: tuple[str, ...]
    engine_kind: str = "vllm"  # which engine served the page: vllm | sglang (sources/sglang_parse.py)

    def copy(self) -> VllmSnapshot:
        """The same snapshot in dicts of its own (the Histograms, tuples, are shared)."""
        engines = {
            key: EngineSample(dict(e.counters), dict(e.gauges), dict(e.histograms), e.start_time)
            for key, e in self.engines.items()
        }
        configs = {engine: dict(config) for engine, config in self.cache_configs.items()}
        return VllmSnapshot(
            engines, configs, self.schema, self.prefix, self.deprecated, self.missing, self.engine_kind
        )

    def model_of(self, engine: str) -> str:
        """cache_config_info has no model_name: join it from the engine's other series."""
        models = sorted({model for model, eng in self.engines if eng == engine})
        return models[0] if models else ""
