"""Monitoring-mixin policy: every alert is named, labelled, annotated, documented and tested;
every recording rule is named level:metric:operations and is exercised by a test."""

from __future__ import annotations

import re

import pytest
import yaml
from alert_harness import AM_CONFIG, ROOT, RULE_TESTS, RULES

from kvcache_exporter.guard import family_of

ALERT_RULES = [r for g in yaml.safe_load((RULES / "alerts.yaml").read_text())["groups"] for r in g["rules"]]
RECORDING = [r for g in yaml.safe_load((RULES / "recording.yaml").read_text())["groups"] for r in g["rules"]]
TESTS = [t for path in RULE_TESTS for t in yaml.safe_load(path.read_text())["tests"]]
RUNBOOK = (ROOT / "docs" / "runbook.md").read_text()
DASHBOARD_UIDS = {"kvcache-overview", "kvcache-cache", "kvcache-gpu-cost", "kvcache-fleet"}
NAMES = sorted({r["alert"] for r in ALERT_RULES})


def alert_cases(name: str) -> list[list]:
    return [
        case.get("exp_alerts") or []
        for t in TESTS
        for case in t.get("alert_rule_test", [])
        if case["alertname"] == name
    ]


@pytest.mark.parametrize("rule", ALERT_RULES, ids=lambda r: f"{r['alert']}-{r['labels']['severity']}")
def test_alert_is_named_labelled_and_annotated(rule):
    assert re.fullmatch(r"KVCache([A-Z0-9][a-z0-9]*|[A-Z]+(?=[A-Z]|$))+", rule["alert"]), (
        "CamelCase, KVCache..."
    )
    assert rule["labels"]["severity"] in {"critical", "warning", "info"}
    assert rule.get("for"), "every alert needs a for:"
    notes = rule["annotations"]
    assert notes["summary"].endswith(".") and "{{" not in notes["summary"], "summary: one static sentence"
    if not rule["alert"].endswith("Absent"):  # absent() and group() have no value or labels to quote
        assert "$value" in notes["description"] and "$labels" in notes["description"]
    assert notes["runbook_url"].endswith("docs/runbook.md#" + rule["alert"].lower())
    if "dashboard_url" in notes:
        uid = notes["dashboard_url"].rsplit("/d/", 1)[1]
        assert uid in DASHBOARD_UIDS and (ROOT / "dashboards" / "json" / f"{uid}.json").exists()


@pytest.mark.parametrize("name", NAMES)
def test_alert_has_a_runbook_section(name):
    assert re.search(rf"^## {name}\s*$", RUNBOOK, re.M), f"docs/runbook.md lacks '## {name}'"


@pytest.mark.parametrize("name", NAMES)
def test_alert_has_firing_and_quiet_promtool_cases(name):
    cases = alert_cases(name)
    assert any(cases), f"no promtool case where {name} fires"
    assert any(not c for c in cases), f"no promtool case where {name} stays quiet"
    severities = {r["labels"]["severity"] for r in ALERT_RULES if r["alert"] == name}
    fired = {a["exp_labels"]["severity"] for c in cases for a in c}
    assert fired == severities, f"{name}: tiers {severities - fired} never fire in a test"


def test_every_recording_rule_is_exercised():
    used = " ".join(
        [r["expr"] for r in ALERT_RULES] + [c["expr"] for t in TESTS for c in t.get("promql_expr_test", [])]
    )
    covered, changed = set(), True
    while changed:  # a rule is covered if a test or an alert uses it, or a covered rule does
        changed = False
        for rule in RECORDING:
            if rule["record"] not in covered and re.search(rf"{re.escape(rule['record'])}\b", used):
                covered.add(rule["record"])
                used += " " + rule["expr"]
                changed = True
    missing = {r["record"] for r in RECORDING} - covered
    assert not missing, f"recording rules no test or alert exercises: {sorted(missing)}"


@pytest.mark.parametrize("rule", RECORDING, ids=lambda r: r["record"])
def test_recording_rule_name(rule):
    assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), "level:metric:operations"


def test_rules_read_only_catalog_metrics():
    text = (RULES / "alerts.yaml").read_text() + (RULES / "recording.yaml").read_text()
    names = {m.group(0) for m in re.finditer(r"(?<![:\w])kvcache_[a-z0-9_]+", text)}
    unknown = sorted(n for n in names if family_of(n) is None)  # a histogram's _bucket is its family's
    assert not unknown, f"not in kvcache_exporter/catalog.py: {unknown}"


def test_inhibitions_and_routes_name_real_alerts():
    config = yaml.safe_load(AM_CONFIG.read_text())
    for rule in config["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            key, value = re.fullmatch(r'(\w+)=~?"(.*)"', matcher).groups()
            pool = NAMES if key == "alertname" else ["critical", "warning", "info"]
            assert any(re.fullmatch(value, n) for n in pool), f"{matcher} matches no alert"
