"""Alert quality with the real rules (alerts/quality.py): no false alert on a normal day, drops
detected within the goals, and docs/alerts.md reports exactly this run."""

from __future__ import annotations

from alert_harness import ROOT, tool

from alerts import quality


def test_hit_ratio_alerts_are_quiet_on_a_normal_day_and_fast_on_drops():
    tool("promtool")
    result = quality.evaluate()
    assert not result["false"], f"false alerts: {result['false']}"
    for name, goal in quality.GOALS.items():
        delays = [d for (scenario, _, _), d in result["delay"].items() if scenario == name]
        assert delays and min(delays) <= goal, f"{name}: detected after {delays}s, goal {goal}s"
    unguarded = quality.without_guard()
    assert unguarded["false"], "the normal day has no trap the traffic guard is needed for"
    assert (ROOT / "docs" / "alerts.md").read_text() == quality.report(result, unguarded), (
        "run python -m alerts.quality --write docs/alerts.md"
    )


def test_normal_day_contains_the_traps():
    qs, _ = quality.simulate(quality.SCENARIOS[0])
    assert "_" in qs, "the vLLM restart leaves scrapes missing"
    after = qs.index("_") + qs.count("_")
    assert int(qs[after]) < int(qs[qs.index("_") - 1]), "counters reset after the restart"
    night = [quality.load(t) * 12 * 1200 for t in (2 * 3600, 23 * 3600)]
    assert max(night) < 100, "night traffic is below the 100 tokens/s guard"
