"""The generated rules are committed, valid, and pass their promtool unit tests."""

from __future__ import annotations

import yaml
from alert_harness import ALERTS, RULE_TESTS, RULES, generate, run, tool


def test_generated_rules_match_the_committed_ones(tmp_path):
    generate(tmp_path)
    for name in ("recording.yaml", "alerts.yaml"):
        assert (tmp_path / name).read_text() == (RULES / name).read_text(), (
            f"{name} drifted: run make generate"
        )


def test_promtool_check_rules():
    run(tool("promtool"), "check", "rules", RULES / "recording.yaml", RULES / "alerts.yaml")


def test_promtool_unit_tests():
    assert RULE_TESTS, "no promtool tests under alerts/tests"
    run(tool("promtool"), "test", "rules", *RULE_TESTS, cwd=ALERTS / "tests")


def test_scaled_copy_keeps_names_and_scales_durations(tmp_path):
    generate(tmp_path, scale=1 / 30)
    run(tool("promtool"), "check", "rules", tmp_path / "recording.yaml", tmp_path / "alerts.yaml")
    full, scaled = (yaml.safe_load((d / "alerts.yaml").read_text()) for d in (RULES, tmp_path))
    floor = [
        (a, b)
        for ga, gb in zip(full["groups"], scaled["groups"], strict=True)
        for a, b in zip(ga["rules"], gb["rules"], strict=True)
        if a["alert"] == "KVCacheHitRatioBelowFloor"
    ]
    (a, b), *_ = floor
    assert (a["for"], b["for"]) == ("5m", "10s")
    assert b["annotations"] == a["annotations"] and b["expr"] == a["expr"]  # ratio_rate5m: same name
    rec = yaml.safe_load((tmp_path / "recording.yaml").read_text())
    exprs = {r["record"]: r["expr"] for g in rec["groups"] for r in g["rules"]}
    assert "[10s]" in exprs["instance_model_name:kvcache_prefix_cache_query_tokens:rate5m"]
    assert rec["groups"][0]["interval"] == "2s"
