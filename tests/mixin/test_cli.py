"""`kvcache-exporter mixin`: every file written, rendered with the user's thresholds, checked by promtool."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from kvcache_exporter import cli
from tests.conftest import REPO

MINE = """
urls: {runbook: https://wiki.example/kv.md, grafana: https://grafana.example}
alerts:
  KVCacheHitRatioBelowFloor: {threshold: 0.45}
"""


def mixin(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["mixin", *args])
    out, err = capsys.readouterr()
    return code, out, err


def rule(out, alert: str) -> dict:
    groups = yaml.safe_load((out / "rules" / "alerts.yaml").read_text())["groups"]
    return next(r for g in groups for r in g["rules"] if r.get("alert") == alert)


def test_defaults_are_the_committed_files(tmp_path, capsys):
    code, printed, _ = mixin(capsys, "--output", str(tmp_path))
    assert code == 0
    written = {str(p) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == set(printed.split()) and len(written) == 2 + 2 + 4
    for name in (
        "kvcache-overview.json",
        "kvcache-cache.json",
        "kvcache-gpu-cost.json",
        "kvcache-fleet.json",
    ):
        assert (tmp_path / "dashboards" / name).read_bytes() == (
            REPO / "dashboards" / "json" / name
        ).read_bytes()
    for name in ("alertmanager.yml", "templates/kvcache.tmpl"):
        assert (tmp_path / "alertmanager" / name).read_bytes() == (
            REPO / "deploy/alertmanager" / name
        ).read_bytes()
    committed = yaml.safe_load((REPO / "alerts" / "rules" / "alerts.yaml").read_text())
    assert yaml.safe_load((tmp_path / "rules" / "alerts.yaml").read_text()) == committed
    amtool = shutil.which("amtool")
    assert amtool, "amtool (Debian's prometheus-alertmanager) is needed: make system-deps"
    checked = subprocess.run([amtool, "check-config", tmp_path / "alertmanager" / "alertmanager.yml"],
                             capture_output=True, text=True)  # fmt: skip
    assert checked.returncode == 0 and " - 1 templates" in checked.stdout, checked.stdout + checked.stderr


def test_a_users_thresholds_reach_rules_and_dashboards(tmp_path, capsys):
    (mine := tmp_path / "mine.yaml").write_text(MINE)
    code, _, err = mixin(capsys, "--output", str(tmp_path / "out"), "--config", str(mine))
    assert code == 0, err
    out = tmp_path / "out"
    floor = rule(out, "KVCacheHitRatioBelowFloor")
    assert "< 0.45\n" in floor["expr"] and "floor of 45%" in floor["annotations"]["description"]
    assert floor["annotations"]["runbook_url"] == "https://wiki.example/kv.md#kvcachehitratiobelowfloor"
    assert floor["annotations"]["dashboard_url"] == "https://grafana.example/d/kvcache-cache"
    assert f"from {mine}" in (out / "rules" / "alerts.yaml").read_text().splitlines()[0]
    overview = (out / "dashboards" / "kvcache-overview.json").read_text()
    assert "https://wiki.example/kv.md#" in overview and "github.com" not in overview
    steps = [
        p["fieldConfig"]["defaults"]["thresholds"]["steps"]
        for p in json.loads(overview)["panels"]
        if p["title"] == "Prefix-cache hit ratio"
    ]
    assert steps == [[{"color": "red", "value": None}, {"color": "green", "value": 0.45}]]
    promtool = shutil.which("promtool")
    assert promtool, "promtool (Debian's prometheus) is needed: make system-deps"
    checked = subprocess.run([promtool, "check", "rules", *map(str, (out / "rules").glob("*.yaml"))])
    assert checked.returncode == 0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("alerts: {KVCacheSaturated: {treshold: 1}}", "alerts.KVCacheSaturated.treshold: unknown key"),
        (
            "slo: {latencies: {TimeToFirstToken: {threshold_seconds: 3}}}",
            "slo.latencies.TimeToFirstToken.threshold_seconds: 3 is not one of vllm:time_to_first_token",
        ),
        ("evaluation_interval: soon", "evaluation_interval: expected a duration"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_1(tmp_path, capsys, text, message):
    (mine := tmp_path / "mine.yaml").write_text(text)
    code, printed, err = mixin(capsys, "--output", str(tmp_path / "out"), "--config", str(mine))
    assert (code, printed) == (1, "")
    assert err.startswith(f"kvcache-exporter mixin: {mine}: ") and message in err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_an_unwritable_output_is_one_line_and_exit_1(tmp_path, capsys):
    (blocker := tmp_path / "file").write_text("")
    code, printed, err = mixin(capsys, "--output", str(blocker / "out"))
    assert (code, printed) == (1, "")
    assert err.startswith(f"kvcache-exporter mixin: {blocker / 'out'}") and "cannot write" in err
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_output_is_required_and_defaults_can_be_printed(capsys):
    assert mixin(capsys)[0] == 1
    code, printed, _ = mixin(capsys, "--print-defaults")
    assert code == 0 and yaml.safe_load(printed) == yaml.safe_load(
        (REPO / "alerts" / "config.yaml").read_text()
    )


def test_dashboards_depend_on_the_config_only_through_its_limits(tmp_path, capsys):
    """Why the pre-rendered JSON may stand in without the SDK when the limits are the defaults."""
    (mine := tmp_path / "mine.yaml").write_text(
        "urls: {grafana: http://g}\nevaluation_interval: 30s\nalerts: {KVCacheSaturated: {for: 20m}}\n"
    )
    assert mixin(capsys, "--output", str(tmp_path / "out"), "--config", str(mine))[0] == 0
    for path in (REPO / "dashboards" / "json").glob("*.json"):
        assert (tmp_path / "out" / "dashboards" / path.name).read_bytes() == path.read_bytes()
