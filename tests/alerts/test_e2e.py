"""End to end with real parts on loopback: simulator -> exporter -> Prometheus (rules generated from
alerts/config.yaml, durations scaled down) -> Alertmanager (deploy/alertmanager) -> a webhook here.
Switching the simulator to the `raw` workload must deliver KVCacheHitRatioBelowFloor."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from alert_harness import AM_CONFIG, generate, tool

pytestmark = [pytest.mark.slow, pytest.mark.prometheus]
SCALE = 1 / 30  # 1m evaluation -> 2s, 5m windows and for: -> 10s
MODEL = "e2e-llama"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/alerts"

    def alerts(self, name: str) -> list[dict]:
        return [a for p in self.payloads for a in p["alerts"] if a["labels"]["alertname"] == name]


def start(stack: ExitStack, tmp: Path, name: str, *cmd: str) -> subprocess.Popen:
    log = (tmp / f"{name}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop():
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()

    stack.callback(stop)
    return proc


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
    prometheus, alertmanager = tool("prometheus"), tool("prometheus-alertmanager", "alertmanager")
    rules = tmp_path / "rules"
    generate(rules, SCALE)
    sim, exp, prom, am = (free_port() for _ in range(4))
    hook = Webhook()

    am_config = yaml.safe_load(AM_CONFIG.read_text())
    am_config["templates"] = [str(AM_CONFIG.parent / "templates" / "*.tmpl")]
    am_config["route"].update(group_wait="1s", group_interval="2s")
    for route in am_config["route"]["routes"]:
        route.pop("group_wait", None)
    for receiver in am_config["receivers"]:
        for webhook in receiver.get("webhook_configs", []):
            webhook["url"] = hook.url
    (tmp_path / "alertmanager.yml").write_text(yaml.safe_dump(am_config))
    (tmp_path / "prometheus.yml").write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "2s"},
                "rule_files": [str(rules / "recording.yaml"), str(rules / "alerts.yaml")],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am}"]}]}]},
                "scrape_configs": [
                    {"job_name": "kvcache-exporter", "static_configs": [{"targets": [f"127.0.0.1:{exp}"]}]}
                ],
            }
        )
    )
    cli = [sys.executable, "-m", "kvcache_exporter"]
    with ExitStack() as stack:
        stack.callback(hook.shutdown)
        start(stack, tmp_path, "simulator", *cli, "simulate", "--listen", f"127.0.0.1:{sim}",
              "--model-name", MODEL, "--workload", "normalized", "--rate", "20")  # fmt: skip
        start(stack, tmp_path, "exporter", *cli, "serve", "--vllm.url", f"http://127.0.0.1:{sim}/metrics",
              "--collect.interval", "1s", "--web.listen-address", f"127.0.0.1:{exp}")  # fmt: skip
        start(stack, tmp_path, "alertmanager", alertmanager, f"--config.file={tmp_path / 'alertmanager.yml'}",
              f"--storage.path={tmp_path / 'am-data'}", f"--web.listen-address=127.0.0.1:{am}",
              "--cluster.listen-address=")  # fmt: skip
        start(stack, tmp_path, "prometheus", prometheus, f"--config.file={tmp_path / 'prometheus.yml'}",
              f"--storage.tsdb.path={tmp_path / 'prom-data'}",
              f"--web.listen-address=127.0.0.1:{prom}")  # fmt: skip

        ratio = "instance_model_name:kvcache_prefix_cache_hit:ratio_rate5m"
        wait_for(
            "a healthy hit ratio (normalized workload)", lambda: promql(prom, f"{ratio} > 0.6"), 90, tmp_path
        )
        assert not hook.alerts("KVCacheHitRatioBelowFloor"), "fired before the workload changed"

        req = urllib.request.Request(
            f"http://127.0.0.1:{sim}/control/workload", data=b'{"name": "raw"}', method="POST",
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
