"""End to end with real parts on loopback: simulator -> exporter -> Prometheus (rules generated from
alerts/config.yaml, durations scaled down) -> Alertmanager (deploy/alertmanager) -> a webhook here.
Switching the simulator to the `raw` workload must deliver KVCacheHitRatioBelowFloor."""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
import urllib.request
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from alert_harness import AM_CONFIG, generate

from kvcache_exporter.tools.harness import Services

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]
SCALE = 1 / 30  # 1m evaluation -> 2s, 5m windows and for: -> 10s
MODEL = "e2e-llama"


class Webhook(ThreadingHTTPServer):
    def __init__(self):
        self.payloads: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                hook.payloads.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.shutdown()
        self.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/alerts"

    def alerts(self, name: str) -> list[dict]:
        return [a for p in self.payloads for a in p["alerts"] if a["labels"]["alertname"] == name]


def wait_for(what: str, check, timeout: float, tmp: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except OSError:
            pass
        time.sleep(0.5)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(tmp.glob("*.log")))
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{logs}")


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def promql(port: int, query: str) -> list[dict]:
    return get(f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": query}))["data"][
        "result"
    ]


def test_raw_workload_pages_through_alertmanager(tmp_path):
    rules = tmp_path / "rules"
    generate(rules, SCALE)
    hook = Webhook()

    am_config = yaml.safe_load(AM_CONFIG.read_text())
    am_config["templates"] = [str(AM_CONFIG.parent / "templates" / "*.tmpl")]
    am_config["route"].update(group_wait="1s", group_interval="2s")
    for route in am_config["route"]["routes"]:
        route.pop("group_wait", None)
    for receiver in am_config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = hook.url
    with Services(tmp_path) as services, closing(hook):
        sim = services.simulator("--model-name", MODEL, "--workload", "normalized", "--rate", "20")
        exporter = services.exporter("--vllm.url", f"{sim.url}/metrics", "--collect.interval", "1s")
        am = services.alertmanager(yaml.safe_dump(am_config))
        prometheus_config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "2s"},
            "rule_files": [str(rules / "recording.yaml"), str(rules / "alerts.yaml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am.port}"]}]}]},
            "scrape_configs": [
                {
                    "job_name": "kvcache-exporter",
                    "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}],
                }
            ],
        }
        prom = services.prometheus(yaml.safe_dump(prometheus_config)).port
        exp = exporter.port

        ratio = "instance_model_name:kvcache_prefix_cache_hit:ratio_rate5m"
        wait_for(
            "a healthy hit ratio (normalized workload)", lambda: promql(prom, f"{ratio} > 0.6"), 90, tmp_path
        )
        assert not hook.alerts("KVCacheHitRatioBelowFloor"), "fired before the workload changed"

        req = urllib.request.Request(
            f"{sim.url}/control/workload", data=b'{"name": "raw"}', method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        urllib.request.urlopen(req, timeout=5).close()

        (alert, *_) = wait_for(
            "KVCacheHitRatioBelowFloor at the webhook",
            lambda: [a for a in hook.alerts("KVCacheHitRatioBelowFloor") if a["status"] == "firing"],
            120,
            tmp_path,
        )
    assert alert["labels"] == {
        "alertname": "KVCacheHitRatioBelowFloor",
        "severity": "critical",
        "job": "kvcache-exporter",
        "instance": f"127.0.0.1:{exp}",
        "model_name": MODEL,
    }
    notes = alert["annotations"]
    assert notes["summary"] == "Prefix-cache hit ratio is below its floor."
    assert f"hit ratio of {MODEL} on 127.0.0.1:{exp} is " in notes["description"]
    assert notes["runbook_url"].endswith("docs/runbook.md#kvcachehitratiobelowfloor")
    assert notes["dashboard_url"].endswith("/d/kvcache-cache")
