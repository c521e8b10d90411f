"""`render` (exposition.py) writes prometheus_client's generate_latest bytes, its line heads kept
between reads: checked against generate_latest on every catalog family, with label values and
numbers from the data at their worst, read after read."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from kvcache_exporter import catalog
from kvcache_exporter.exposition import LineHeads, SampleCollector, registry_for, render, text
from kvcache_exporter.samples import Sample
from tests.fuzzing import fuzz_settings

label_value = st.text(max_size=8) | st.sampled_from(['a"b', "c\\d", "e\nf", "é", "", "\\n", '\\"'])
number = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e21, 12345678.0, 0.1])


def family_samples(spec: catalog.Metric, values: list[str], number: float) -> list[Sample]:
    labels = {name: values[i % len(values)] for i, name in enumerate(spec.labels)} if values else {}
    if spec.type == "summary":
        return [
            Sample(spec.name, {**labels, "quantile": "0.5"}, number),
            Sample(spec.name + "_count", labels, 3.0),
            Sample(spec.name + "_sum", labels, number),
        ]
    if spec.type == "histogram":
        return [
            Sample(spec.name + "_bucket", {**labels, "le": "+Inf"}, 3.0),
            Sample(spec.name + "_count", labels, 3.0),
            Sample(spec.name + "_sum", labels, number),
        ]
    return [Sample(spec.name, labels, number)]


def reference(samples: list[Sample]) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SampleCollector(lambda: samples))
    return generate_latest(registry).decode()


@fuzz_settings(100)
@given(st.lists(st.tuples(st.lists(label_value, min_size=1, max_size=3), number), min_size=1, max_size=3))
def test_every_family_reads_as_generate_latest_writes_it_read_after_read(reads):
    heads = LineHeads(max_entries=300)  # forgets mid-way: a cleared cache writes the same
    for values, value in reads:
        samples = [s for spec in catalog.CATALOG for s in family_samples(spec, values, value)]
        collector = SampleCollector(lambda samples=samples: samples)
        assert text(collector.collect(), heads) == reference(samples)


def test_render_is_the_samples_then_every_other_collector_in_order():
    samples = [Sample(catalog.CATALOG[0].name, dict.fromkeys(catalog.CATALOG[0].labels, "x"), math.pi)]
    registry = registry_for(lambda: samples)
    later = CollectorRegistry(auto_describe=False)
    later.register(SampleCollector(lambda: [Sample(catalog.CATALOG[1].name, {}, 2.0)]))
    registry.register(later)  # as the endpoint adds its own families
    page = render(registry).decode()
    ours, _, rest = page.partition("# HELP process_")
    assert ours == reference(samples)
    assert "process_cpu_seconds_total" in rest or not rest  # no /proc: no process families
    assert page.endswith(generate_latest(later).decode())
