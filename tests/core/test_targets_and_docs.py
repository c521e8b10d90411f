import asyncio

from kvcache_exporter import catalog, docs
from kvcache_exporter.tools.exporters import vllm_exporter
from tests.conftest import REPO
from tests.replay import ReplaySource, seed_snapshots


def test_several_targets_carry_a_target_label(shared_fixtures):
    texts = [s["text"] for s in seed_snapshots(shared_fixtures)]
    exporter = vllm_exporter(
        {"a:8000": ReplaySource(texts[:1]), "b:8000": ReplaySource(texts[-1:])},
        windows=[60],
        quantiles=[0.5],
        interval=5,
    )
    asyncio.run(exporter.poll_once())
    queries = {
        s.labels["target"]: s.value
        for s in exporter.latest
        if s.name == "kvcache_prefix_cache_query_tokens_total"
    }
    assert queries == {"a:8000": 0.0, "b:8000": 81822.0}  # the run's first and last snapshots
    per_target = [s for s in exporter.latest if catalog.get(_family(s.name)).per_target]
    assert per_target and all("target" in s.labels for s in per_target)


def _family(name):
    for suffix in ("_count", "_sum"):
        if name.endswith(suffix) and name.removesuffix(suffix) in catalog.BY_NAME:
            return name.removesuffix(suffix)
    return name


def test_metrics_doc_is_generated_from_the_catalog():
    assert (REPO / "docs" / "metrics.md").read_text() == docs.metrics_markdown(), "run make generate"
    for metric in catalog.CATALOG:
        assert metric.name.startswith("kvcache_") and ":" not in metric.name
        assert metric.help.endswith((".", ")")), metric.name
        if metric.type == "counter":
            assert metric.name.endswith("_total"), metric.name
