"""Samples -> Prometheus text, with names, types and HELP from the catalog."""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics import exposition as openmetrics
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample as ClientSample
from prometheus_client.utils import floatToGoString

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


class Registry(CollectorRegistry):
    """Our samples, the process collector's and any registered later (the endpoint's own), in that
    order; `render` formats each of our sample lines' name and labels once, not at every read."""

    def __init__(self, latest: Callable[[], list[Sample]]):
        super().__init__(auto_describe=False)
        self.order: list[Collector] = []
        self.samples = SampleCollector(latest)
        self.lines = LineHeads()
        self.register(self.samples)
        self.register(ProcessCollector(registry=None))

    def register(self, collector: Collector) -> None:
        super().register(collector)
        self.order.append(collector)

    def unregister(self, collector: Collector) -> None:
        super().unregister(collector)
        self.order.remove(collector)


def registry_for(latest: Callable[[], list[Sample]]) -> Registry:
    return Registry(latest)


def render(registry: CollectorRegistry) -> bytes:
    """generate_latest(registry)'s bytes."""
    if not isinstance(registry, Registry) or registry.get_target_info() is not None:
        return generate_latest(registry)
    return b"".join(
        text(c.collect(), registry.lines).encode() if c is registry.samples else generate_latest(c)
        for c in registry.order
    )


class LineHeads:
    """Each sample line's text before its value, by (name, labels), as generate_latest writes it; a
    derived page is the same ~700 series read after read (a scrape was ~2 ms, most of it escaping
    and joining the same labels again). Forgets all past `max_entries` (label values that churn)."""

    def __init__(self, max_entries: int = 100_000):
        self.max_entries = max_entries
        self.heads: dict[tuple, str] = {}
        self.families: dict[tuple[str, str, str], tuple[str, str]] = {}

    def line(self, sample: ClientSample) -> str:
        key = (sample.name, *sample.labels.items())
        head = self.heads.get(key)
        if head is None:
            if len(self.heads) >= self.max_entries:
                self.heads.clear()
            head = self.heads[key] = _line_head(sample.name, sample.labels)
        stamp = "" if sample.timestamp is None else f" {int(float(sample.timestamp) * 1000):d}"
        return f"{head} {floatToGoString(sample.value)}{stamp}\n"

    def family(self, name: str, kind: str, documentation: str) -> tuple[str, str]:
        """A family's # HELP and # TYPE lines."""
        found = self.families.get((name, kind, documentation))
        if found is None:
            found = self.families[(name, kind, documentation)] = _family_head(name, kind, documentation)
        return found


def text(metrics: Iterable[Metric], lines: LineHeads) -> str:
    """prometheus_client's generate_latest (0.26) over `metrics`, its line heads from `lines`."""
    output: list[str] = []
    for metric in metrics:
        output += lines.family(metric.name, metric.type, metric.documentation)
        created: dict[str, list[str]] = {}
        for sample in metric.samples:
            for suffix in ("_created", "_gsum", "_gcount"):
                if sample.name == metric.name + suffix:  # OpenMetrics only: a gauge at the end
                    created.setdefault(suffix, []).append(lines.line(sample))
                    break
            else:
                output.append(lines.line(sample))
        for suffix, extra in sorted(created.items()):
            output += lines.family(metric.name + suffix, "gauge", metric.documentation)
            output += extra
    return "".join(output)


def _family_head(name: str, kind: str, documentation: str) -> tuple[str, str]:
    munged = {
        "counter": (name + "_total", kind),
        "info": (name + "_info", "gauge"),
        "stateset": (name, "gauge"),
        "gaugehistogram": (name, "histogram"),
        "unknown": (name, "untyped"),
    }
    name, kind = munged.get(kind, (name, kind))
    escaped = openmetrics.escape_metric_name(name, openmetrics.UNDERSCORES)
    help_text = documentation.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {escaped} {help_text}\n", f"# TYPE {escaped} {kind}\n"


def _line_head(name: str, labels: dict[str, str]) -> str:
    escape_name, escape_value = openmetrics.escape_label_name, openmetrics._escape
    pairs = ",".join(  # as generate_latest: label values always UTF-8
        f'{escape_name(k, openmetrics.UNDERSCORES)}="{escape_value(v, openmetrics.ALLOWUTF8, False)}"'
        for k, v in sorted(labels.items())
    )
    return openmetrics.escape_metric_name(name, openmetrics.UNDERSCORES) + (f"{{{pairs}}}" if pairs else "")
