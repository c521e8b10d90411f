"""The committed dashboard JSON: regenerated without drift, and every panel built to the house rules."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml
from dashboard_harness import JSON_DIR, ROOT, UIDS, boards, panels
from grafana_foundation_sdk.models import units

SDK_UNITS = {v for k, v in vars(units).items() if not k.startswith("_") and isinstance(v, str)}
# The alerts the generated rules define, and the runbook sections (anchors) that exist.
ALERTS = {
    rule["alert"]
    for group in yaml.safe_load((ROOT / "alerts" / "rules" / "alerts.yaml").read_text())["groups"]
    for rule in group["rules"]
    if "alert" in rule
}
RUNBOOK_ANCHORS = {
    line[3:].strip().lower()
    for line in (ROOT / "docs" / "runbook.md").read_text().splitlines()
    if line.startswith("## ")
}
VARIABLES = ["datasource", "job", "instance", "host", "model_name", "engine", "engine_kind", "window"]
PER_SECOND_UNITS = {
    units.OpsPerSecond,
    units.RequestsPerSecond,
    units.BytesPerSecondSI,
    "binBps",
    "watt",
}  # W = J/s


def unit_ok(unit: str | None) -> bool:
    """An SDK unit, or a custom one whose suffix names what is counted ("suffix: tokens/s")."""
    return unit in SDK_UNITS or (unit or "").startswith("suffix: ")


def query_units(panel: dict) -> dict[str, str | None]:
    """Each target's unit: its own override (by refId) or the panel's."""
    own = {
        o["matcher"]["options"]: p["value"]
        for o in panel.get("fieldConfig", {}).get("overrides", [])
        if o["matcher"]["id"] == "byFrameRefID"
        for p in o["properties"]
        if p["id"] == "unit"
    }
    default = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
    return {t["refId"]: own.get(t["refId"], default) for t in panel.get("targets", [])}


def generate(tmp_path, *args: str) -> dict[str, bytes]:
    cmd = [sys.executable, "-m", "dashboards", "--out", str(tmp_path), *args]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    return {p.name: p.read_bytes() for p in sorted(tmp_path.glob("*.json"))}


def changed_config(tmp_path, change) -> str:
    cfg = yaml.safe_load((ROOT / "alerts" / "config.yaml").read_text())
    change(cfg)
    (path := tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    return str(path)


def test_committed_json_matches_the_code(tmp_path):
    committed = {p.name: p.read_bytes() for p in sorted(JSON_DIR.glob("*.json"))}
    assert generate(tmp_path) == committed, "dashboards/json is stale: run `make generate` and commit"


def test_runbook_base_is_configurable(tmp_path):
    config = changed_config(
        tmp_path, lambda cfg: cfg["urls"].update(runbook="https://runbooks.example/kv.md")
    )
    out = generate(tmp_path / "out", "--config", config)
    text = b"".join(out.values()).decode()
    assert "https://runbooks.example/kv.md#kvcachesaturated" in text
    assert "github.com" not in text


def _stat(board: dict, title: str) -> dict:
    return next(p for p in panels(board) if p["title"] == title)


def _steps(panel: dict) -> list:
    return [step["value"] for step in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]]


def test_dashboard_thresholds_follow_the_alerts_config(tmp_path):
    committed = json.loads((JSON_DIR / "kvcache-overview.json").read_text())
    assert _steps(_stat(committed, "TTFT p99")) == [None, 2.5]  # the alert's SLO threshold
    assert _steps(_stat(committed, "Prefix-cache hit ratio")) == [None, 0.6]

    def change(cfg):
        cfg["alerts"]["KVCacheHitRatioBelowFloor"]["threshold"] = 0.75
        cfg["slo"]["latencies"]["TimeToFirstToken"]["threshold_seconds"] = 5

    out = generate(tmp_path / "out", "--config", changed_config(tmp_path, change))
    board = json.loads(out["kvcache-overview.json"])
    assert _steps(_stat(board, "TTFT p99")) == [None, 5]
    assert _steps(_stat(board, "Prefix-cache hit ratio")) == [None, 0.75]
    sla = next(v for v in board["templating"]["list"] if v["name"] == "ttft_sla")
    assert sla["query"] == "5"
    cache = json.loads(out["kvcache-cache.json"])
    assert _steps(_stat(cache, "Hit ratio from the token counters")) == [None, 0.75]


def test_fixed_uids_and_shared_variables():
    assert sorted(boards()) == sorted(UIDS)
    for uid, board in boards().items():
        assert board["uid"] == uid
        names = [v["name"] for v in board["templating"]["list"]]
        assert names[: len(VARIABLES)] == VARIABLES, uid
        assert "kvcache" in board["tags"]


@pytest.mark.parametrize("uid", UIDS)
def test_every_panel_explains_itself_and_links_the_runbook(uid):
    for panel in panels(boards()[uid]):
        if panel["type"] == "row":
            continue
        where = f"{uid} / {panel['title']}"
        text = panel.get("description", "")
        assert re.search(r"Reads: `[\w:]+`", text) and "When it looks wrong: " in text, where
        anchors = [link["url"].partition("#")[2] for link in panel.get("links", [])]
        assert anchors, f"{where}: no runbook link"
        assert set(anchors) <= {a.lower() for a in ALERTS} | {""}, where
        assert set(anchors) - {""} <= RUNBOOK_ANCHORS, where
        assert all(map(unit_ok, query_units(panel).values())), where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where


@pytest.mark.parametrize("uid", UIDS)
def test_ratios_are_guarded_against_division_by_zero(uid):
    for panel in panels(boards()[uid]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            assert expr.count(" / ") == expr.count(") > 0)"), f"{panel['title']}: {expr}"


@pytest.mark.parametrize("uid", UIDS)
def test_rates_carry_per_second_units(uid):
    """A rate (not a ratio of rates, not a quantile) is shown per second, with what it counts."""
    for panel in panels(boards()[uid]):
        got = query_units(panel)
        for target in panel.get("targets", []):
            expr = target["expr"]
            if "rate(" in expr and " / " not in expr and "histogram_quantile" not in expr:
                unit = got[target["refId"]]
                assert unit in PER_SECOND_UNITS or unit.endswith("/s"), f"{panel['title']}: {unit} {expr}"


@pytest.mark.parametrize("uid", UIDS)
def test_no_window_is_hard_coded_and_vllm_series_follow_the_instance(uid):
    for panel in panels(boards()[uid]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            assert 'window="' not in expr, f"{panel['title']}: {expr}"  # the $window variable instead
            for selector in re.findall(r"vllm:\w+\{[^}]*\}", expr):
                assert 'instance=~"$host:[0-9]+"' in selector, f"{panel['title']}: {selector}"


def test_the_overview_says_why_and_what_the_fix_is_worth():
    from kvcache_exporter.derive.attribution import CAUSES

    titles = {p["title"]: p for p in panels(boards()["kvcache-overview"])}
    why = titles["Why the cache misses"]["targets"][0]
    assert why["legendFormat"] == "{{cause}}: {{action}}"
    assert "label_replace(" in why["expr"] and "topk(1," in why["expr"]
    for cause in CAUSES:  # each cause the attribution names comes with its action
        assert f'"{cause}")' in why["expr"], cause
    worth = " ".join(t["expr"] for t in titles["What each fix is worth (hit ratio)"]["targets"])
    for metric in ("ratio_reordered_estimate", "ratio_estimate", "ratio_host_tier_estimate"):
        assert f"kvcache_prefix_cache_hit_{metric}{{" in worth


def test_every_alert_has_a_panel_linking_its_runbook():
    linked = {
        link["url"].partition("#")[2]
        for board in boards().values()
        for panel in panels(board)
        for link in panel.get("links", [])
    }
    assert {a.lower() for a in ALERTS} - linked == set()


def test_every_panel_split_by_cause_draws_each_cause_in_the_analyzers_colour():
    from kvcache_exporter.derive.attribution import CAUSES
    from kvcache_exporter.mixin.palette import CAUSE_COLORS, LIVE_CAUSE_COLORS

    by_cause = [
        p
        for board in boards().values()
        for p in panels(board)
        if any("by (cause)" in t.get("expr", "") and "topk" not in t["expr"] for t in p.get("targets", []))
    ]
    assert by_cause  # the attribution row's "Miss tokens by cause"
    for panel in by_cause:
        fixed = {
            o["matcher"]["options"]: prop["value"]["fixedColor"]
            for o in panel["fieldConfig"]["overrides"]
            if o["matcher"]["id"] == "byName"
            for prop in o["properties"]
            if prop["id"] == "color"
        }
        assert fixed == CAUSE_COLORS | LIVE_CAUSE_COLORS, panel["title"]
        assert set(CAUSES) <= fixed.keys()  # every cause the live attribution names


def test_the_fleet_row_is_on_the_fleet_dashboard_only():
    rows = {uid: [p["title"] for p in boards()[uid]["panels"] if p["type"] == "row"] for uid in UIDS}
    assert rows["kvcache-fleet"] == ["Fleet"]
    assert all("Fleet" not in titles for uid, titles in rows.items() if uid != "kvcache-fleet"), rows
    fleet = " ".join(t["expr"] for p in panels(boards()["kvcache-fleet"]) for t in p.get("targets", []))
    cache = " ".join(t["expr"] for p in panels(boards()["kvcache-cache"]) for t in p.get("targets", []))
    assert "kvcache_fleet_" in fleet and "kvcache_fleet_" not in cache


def test_block_size_and_token_capacity_have_a_panel_each():
    for panel in panels(boards()["kvcache-cache"]):
        metrics = {m for t in panel.get("targets", []) for m in re.findall(r"kvcache_\w+", t["expr"])}
        assert not {"kvcache_capacity_tokens", "kvcache_block_size_tokens"} <= metrics, panel["title"]


def test_every_cost_panel_names_the_exporters_currency():
    cost = [
        (uid, p["title"])
        for uid in UIDS
        for p in panels(boards()[uid])
        if any("cost_per" in t["expr"] or "cost_per_hour" in t["expr"] for t in p.get("targets", []))
    ]
    assert cost and all("($currency)" in title for _, title in cost), cost
    for uid in UIDS:
        currency = next(v for v in boards()[uid]["templating"]["list"] if v["name"] == "currency")
        assert "kvcache_cost_info" in json.dumps(currency["query"]) and currency["current"]["value"] == "USD"
