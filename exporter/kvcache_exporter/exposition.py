"""Samples -> Prometheus text, with names, types and HELP from the catalog."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import __version__, catalog
from . import catalog as c
from .samples import Sample, label_value


def families(samples: Iterable[Sample]) -> list[Metric]:
    """Group samples into metric families. A name missing from the catalog is a bug: KeyError.
    A family takes its first sample's label names (one without some of them has them empty, which
    Prometheus reads as absent); a sample with a name beyond them keeps its own labels (collector
    success of a discovery has no `replica`, a replica's has one: it lost it, a duplicate series)."""
    grouped: dict[str, list[Sample]] = {}
    for sample in samples:
        grouped.setdefault(_summary_of(sample.name) or sample.name, []).append(sample)
    return [_family(name, members) for name, members in grouped.items()]


def _family(family_name: str, samples: list[Sample]) -> Metric:
    spec = catalog.get(family_name)
    if spec.type in ("summary", "histogram"):
        family = Metric(family_name, spec.help, spec.type)
        for name, labels, value in samples:
            family.add_sample(name, _safe(labels), value)
        return family
    label_names = list(samples[0].labels)
    kind = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    family = kind(family_name, spec.help, labels=label_names)
    sample_name = family.name + "_total" if spec.type == "counter" else family.name
    for _, labels, value in samples:
        if labels.keys() <= set(label_names):
            family.add_metric([label_value(labels.get(key, "")) for key in label_names], value)
        else:
            family.add_sample(sample_name, _safe(labels), value)
    return family


def _safe(labels: dict[str, str]) -> dict[str, str]:
    """Every label value as it may be exported (samples.label_value): the last line of defence for
    values that come from the data."""
    return {key: label_value(value) for key, value in labels.items()}


def _summary_of(name: str) -> str | None:
    """`x_count` / `x_sum` (and a histogram's `x_bucket`) belong to the summary or histogram `x`."""
    base, _, suffix = name.rpartition("_")
    spec = catalog.BY_NAME.get(base)
    if spec is None or suffix not in ("count", "sum", "bucket"):
        return None
    return base if spec.type == "histogram" or (spec.type == "summary" and suffix != "bucket") else None


def build_info() -> Sample:
    return Sample(
        c.EXPORTER_BUILD_INFO,
        {"version": __version__, "python_version": platform.python_version()},
        1.0,
    )


class SampleCollector(Collector):
    """Serves whatever the poll loop derived last; a scrape does no work beyond formatting."""

    def __init__(self, latest: Callable[[], list[Sample]]):
        self.latest = latest

    def collect(self) -> Iterable[Metric]:
        return families([build_info(), *self.latest()])


def registry_for(latest: Callable[[], list[Sample]]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(latest))
    registry.register(ProcessCollector(registry=None))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
