"""One catalog of names: every family has its constant, and code names families only through them."""

import re
from pathlib import Path

from kvcache_exporter import catalog
from tests.conftest import REPO

PACKAGE = REPO / "exporter" / "kvcache_exporter"
# Rules and dashboards name families inside PromQL text; their tests check every name they reference
# against the catalog and a real Prometheus, so the mixin is outside this check.
PROMQL = PACKAGE / "mixin"
# The catalog and the modules whose entries it concatenates (a source's own, beside its code).
DECLARING = {PACKAGE / "catalog.py", *(Path(m.__file__) for m in catalog.DECLARED)}


def test_every_family_has_its_constant_and_back():
    for metric in catalog.CATALOG:
        assert getattr(catalog, catalog.constant_name(metric.name)) == metric.name
    constants = {v for k, v in vars(catalog).items() if k.isupper() and str(v).startswith("kvcache_")}
    assert constants == set(catalog.BY_NAME)


def test_no_module_spells_a_family_name_itself():
    """A typo in a literal would only show when /metrics renders; a constant fails at import."""
    literal = re.compile(r"""["'](kvcache_[a-z0-9_]+)["'{]""")
    offenders = [
        f"{path.relative_to(REPO)}: {name}"
        for path in PACKAGE.rglob("*.py")
        if path not in DECLARING and PROMQL not in path.parents
        for name in literal.findall(path.read_text())
        if name in catalog.BY_NAME or any(name.startswith(f) for f in catalog.BY_NAME)
    ]
    assert offenders == []


def test_the_catalog_holds_each_declaring_modules_entries_whole_and_in_order():
    for module in catalog.DECLARED:
        for section in getattr(module, "SECTIONS", (module.METRICS,)):
            at = catalog.CATALOG.index(section[0])
            assert catalog.CATALOG[at : at + len(section)] == section, module.__name__
        assert all(getattr(catalog, catalog.constant_name(m.name)) == m.name for m in module.METRICS)


def test_value_ranges_follow_units():
    assert catalog.get(catalog.PREFIX_CACHE_HIT_RATIO).value_range == (0.0, 1.0)
    assert catalog.get(catalog.GENERATION_TOKENS_PER_SECOND).value_range[0] == 0.0
    assert catalog.get(catalog.GPU_MEMORY_BUDGET_USAGE_RATIO).value_range[1] > 1
