"""What the wheel ships under kvcache_exporter/mixin/data is a copy of the repository's sources."""

from __future__ import annotations

import pytest

from kvcache_exporter.mixin.config import data_path
from tests.conftest import REPO

SOURCES = {"config.yaml": REPO / "alerts" / "config.yaml"}
SOURCES |= {
    f"alertmanager/{p.relative_to(REPO / 'deploy' / 'alertmanager')}": p
    for p in (REPO / "deploy" / "alertmanager").rglob("*")
    if p.is_file()
}
SOURCES |= {f"dashboards/{p.name}": p for p in (REPO / "dashboards" / "json").glob("*.json")}


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_shipped_copy_matches_its_source(name):
    shipped = data_path(*name.split("/"))
    assert shipped.read_bytes() == SOURCES[name].read_bytes(), f"{name} is stale: run `make generate`"


def test_nothing_else_is_shipped():
    root = data_path()
    shipped = {
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and "__pycache__" not in str(p)
    }
    assert shipped == set(SOURCES)
