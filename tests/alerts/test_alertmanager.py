"""Alertmanager config: valid, routes by severity, templates render value, model, pod and runbook."""

from __future__ import annotations

import json

import pytest
from alert_harness import AM_CONFIG, run, tool


def test_amtool_check_config():
    out = run(tool("amtool"), "check-config", AM_CONFIG).stdout
    assert "SUCCESS" in out and "3 inhibit rules" in out and "1 templates" in out


@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["severity=critical", "alertname=KVCacheHitRatioBelowFloor"], "page"),
        (["severity=warning", "alertname=KVCacheSaturated"], "ticket"),
        (["severity=info", "alertname=KVCacheVLLMMetricsDeprecated"], "blackhole"),
        (["alertname=SomethingUnlabelled"], "ticket"),
    ],
)
def test_routes_by_severity(labels, receiver):
    out = run(tool("amtool"), "config", "routes", "test", f"--config.file={AM_CONFIG}", *labels).stdout
    assert out.split() == [receiver]


def test_templates_render_value_model_pod_and_runbook(tmp_path):
    labels = {"alertname": "KVCacheHitRatioBelowFloor", "severity": "critical", "model_name": "llama"}
    labels |= {"pod": "vllm-0", "instance": "exporter:9400"}
    annotations = {
        "summary": "Prefix-cache hit ratio is below its floor.",
        "description": "The prefix-cache hit ratio of llama on exporter:9400 (pod vllm-0) is 30%.",
        "runbook_url": "https://example/docs/runbook.md#kvcachehitratiobelowfloor",
    }
    alert = {"status": "firing", "labels": labels, "annotations": annotations}
    data = {"status": "firing", "alerts": [alert], "commonLabels": alert["labels"]}
    (tmp_path / "data.json").write_text(json.dumps(data))
    out = run(
        tool("amtool"),
        "template",
        "render",
        f"--template.glob={AM_CONFIG.parent / 'templates' / '*.tmpl'}",
        f"--template.data={tmp_path / 'data.json'}",
        '--template.text={{ template "kvcache.title" . }}\n{{ template "kvcache.text" . }}',
    ).stdout
    assert out.startswith("[FIRING:1] KVCacheHitRatioBelowFloor (llama)")
    assert "[CRITICAL] Prefix-cache hit ratio is below its floor." in out
    assert "is 30%." in out and "model: llama  pod: vllm-0  instance: exporter:9400" in out
    assert "runbook: https://example/docs/runbook.md#kvcachehitratiobelowfloor" in out
