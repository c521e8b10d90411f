"""The committed dashboard JSON: regenerated without drift, and every panel built to the house rules."""

from __future__ import annotations

import os
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
VARIABLES = ["datasource", "job", "instance", "model_name", "engine"]


def generate(tmp_path, *args: str) -> dict[str, bytes]:
    env = {k: v for k, v in os.environ.items() if k != "KVCACHE_RUNBOOK_URL"}
    cmd = [sys.executable, "-m", "dashboards", "--out", str(tmp_path), *args]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    return {p.name: p.read_bytes() for p in sorted(tmp_path.glob("*.json"))}


def test_committed_json_matches_the_code(tmp_path):
    committed = {p.name: p.read_bytes() for p in sorted(JSON_DIR.glob("*.json"))}
    assert generate(tmp_path) == committed, "dashboards/json is stale: run `make generate` and commit"


def test_runbook_base_is_configurable(tmp_path):
    out = generate(tmp_path, "--runbook-url", "https://runbooks.example/kv.md")
    text = b"".join(out.values()).decode()
    assert "https://runbooks.example/kv.md#kvcachesaturated" in text
    assert "github.com" not in text


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
        assert panel["fieldConfig"]["defaults"].get("unit") in SDK_UNITS, where
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, where


@pytest.mark.parametrize("uid", UIDS)
def test_ratios_are_guarded_against_division_by_zero(uid):
    for panel in panels(boards()[uid]):
        for target in panel.get("targets", []):
            expr = target["expr"]
            assert expr.count(" / ") == expr.count(") > 0)"), f"{panel['title']}: {expr}"


def test_every_alert_has_a_panel_linking_its_runbook():
    linked = {
        link["url"].partition("#")[2]
        for board in boards().values()
        for panel in panels(board)
        for link in panel.get("links", [])
    }
    assert {a.lower() for a in ALERTS} - linked == set()
