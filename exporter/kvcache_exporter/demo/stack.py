"""Process management for the demo: free ports, generated configs in a temp dir, start/wait/stop."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from .. import catalog as c
from ..mixin import config as mixin_config
from ..mixin import rules
from ..tools.harness import alertmanager_argv, free_port, prometheus_argv

PROMETHEUS_NAMES = ("prometheus",)
ALERTMANAGER_NAMES = ("prometheus-alertmanager", "alertmanager")


def which(names: tuple[str, ...]) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


def http_get(url: str, timeout: float = 2.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def wait_http(url: str, deadline_s: float, proc: subprocess.Popen | None = None, needle: bytes = b"") -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            return False
        with contextlib.suppress(OSError, ValueError):
            if needle in http_get(url, timeout=1.0):
                return True
        time.sleep(0.2)
    return False


@dataclass
class Service:
    name: str
    url: str
    proc: subprocess.Popen
    log_path: Path


@dataclass
class Stack:
    """Everything the demo runs; `stop()` terminates in reverse start order and removes the temp dir."""

    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvcache-demo-")))
    services: dict[str, Service] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def _spawn(self, name: str, argv: list[str], url: str) -> Service:
        log_path = self.workdir / f"{name}.log"
        log = open(log_path, "wb")  # noqa: SIM115 - closed with the process in stop()
        proc = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
            start_new_session=True,  # Ctrl-C reaches the demo only; it stops the children in order
        )
        log.close()
        service = Service(name, url, proc, log_path)
        self.services[name] = service
        return service

    def log_tail(self, name: str, lines: int = 15) -> str:
        path = self.workdir / f"{name}.log"
        try:
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def _require(self, service: Service, ready_url: str, timeout: float, needle: bytes = b"") -> None:
        if not wait_http(ready_url, timeout, service.proc, needle):
            raise RuntimeError(
                f"{service.name} did not come up on {service.url}:\n{self.log_tail(service.name)}"
            )

    # --- components ---------------------------------------------------------------------

    def start_simulator(self, schedule: str, speed: float, rate: float, extra: list[str]) -> Service:
        port = free_port()
        argv = [sys.executable, "-m", "kvcache_exporter.simulator", "--listen", f"127.0.0.1:{port}"]
        argv += ["--schedule", schedule, "--speed", str(speed), "--rate", str(rate), *extra]
        service = self._spawn("simulator", argv, f"http://127.0.0.1:{port}")
        self._require(service, service.url + "/health", 20)
        return service

    def start_exporter(
        self,
        sim_url: str,
        interval: str,
        windows: list[str],
        price: float,
        kv_events: str | None = None,
        currency: str = "USD",
    ) -> Service:
        port = free_port()
        argv = [sys.executable, "-m", "kvcache_exporter", "serve", "--vllm.url", f"{sim_url}/metrics"]
        if kv_events:  # the exporter binds; the simulator's PUB connects to it (as vLLM's does)
            argv += ["--kv-events.endpoint", kv_events, "--kv-events.mode", "bind"]
        argv += ["--collect.interval", interval, "--web.listen-address", f"127.0.0.1:{port}"]
        for window in windows:
            argv += ["--collect.windows", window]
        argv += ["--gpu.source", "dcgm", "--gpu.dcgm-url", f"{sim_url}/dcgm/metrics"]
        argv += ["--gpu.pod", "vllm-0", "--gpu.namespace", "default"]  # the simulator's dcgm labels
        argv += ["--cost.gpu-hour-price", str(price), "--cost.currency", currency]
        service = self._spawn("exporter", argv, f"http://127.0.0.1:{port}/metrics")
        self._require(service, service.url, 20, c.VLLM_UP.encode())
        return service

    def start_nats(self, binary: str) -> Service:
        """nats-server with JetStream, its store in the temp dir; ready once its /healthz says so."""
        port, monitor = free_port(), free_port()
        argv = [binary, "-js", "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)]
        argv += ["-sd", str(self.workdir / "jetstream")]
        service = self._spawn("nats-server", argv, f"nats://127.0.0.1:{port}")
        self._require(service, f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true", 20, b"ok")
        return service

    def start_sidecar(
        self, replica: str, metrics_url: str, kv_events: str, nats_url: str, pool: str
    ) -> Service:
        """`serve` beside one replica, publishing its residency to NATS (`--fleet.publish`)."""
        port = free_port()
        argv = [sys.executable, "-m", "kvcache_exporter", "serve", "--vllm.url", metrics_url]
        argv += ["--kv-events.endpoint", kv_events, "--kv-events.mode", "connect", "--collect.interval", "1s"]
        argv += ["--web.listen-address", f"127.0.0.1:{port}"]
        argv += ["--fleet.publish", nats_url, "--fleet.pool", pool, "--fleet.replica", replica]
        service = self._spawn(f"sidecar-{replica}", argv, f"http://127.0.0.1:{port}/metrics")
        self._require(service, service.url, 60, c.VLLM_UP.encode())
        return service

    def rule_files(self, scale: float) -> list[str]:
        """The packaged mixin's rules, with every duration times `scale` (so a drop in a short demo
        phase can fire), when valid for this Prometheus; else none."""
        files = [str(p) for p in rules.write(self.workdir / "rules", mixin_config.defaults(), scale)]
        promtool = shutil.which("promtool")
        if promtool is None:
            return files
        check = subprocess.run([promtool, "check", "rules", *files], capture_output=True, text=True)
        if check.returncode != 0:
            self.notes.append("alert rules skipped: promtool check rules failed:\n" + check.stdout[-800:])
            return []
        return files

    def start_alertmanager(self, binary: str) -> Service:
        port = free_port()
        config = mixin_config.data_path("alertmanager", "alertmanager.yml")
        argv = alertmanager_argv(config, self.workdir / "alertmanager-data", port, command=binary)
        service = self._spawn("alertmanager", argv, f"http://127.0.0.1:{port}")
        self._require(service, service.url + "/-/ready", 30)
        return service

    def start_prometheus(
        self, binary: str, exporter_url: str, sim_url: str, alertmanager_url: str | None, alert_scale: float
    ) -> Service:
        port = free_port()
        exporter_target = exporter_url.split("//", 1)[1].split("/", 1)[0]
        sim_target = sim_url.split("//", 1)[1]
        config: dict = {
            "global": {"scrape_interval": "2s", "evaluation_interval": "2s"},
            "rule_files": self.rule_files(alert_scale),
            "scrape_configs": [
                {"job_name": "kvcache-exporter", "static_configs": [{"targets": [exporter_target]}]},
                {"job_name": "vllm", "static_configs": [{"targets": [sim_target]}]},
                {
                    "job_name": "dcgm",
                    "metrics_path": "/dcgm/metrics",
                    "static_configs": [{"targets": [sim_target]}],
                },
            ],
        }
        if alertmanager_url:
            target = alertmanager_url.split("//", 1)[1]
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [target]}]}]}
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argv = prometheus_argv(
            path, self.workdir / "prometheus-data", port, "--storage.tsdb.retention.time=1d", command=binary
        )
        service = self._spawn("prometheus", argv, f"http://127.0.0.1:{port}")
        self._require(service, service.url + "/-/ready", 40)
        return service

    def alerts(self) -> list[dict] | None:
        """Prometheus's pending and firing alerts, or None when Prometheus does not run or answer."""
        prometheus = self.services.get("prometheus")
        if prometheus is None:
            return None
        try:
            body = json.loads(http_get(prometheus.url + "/api/v1/alerts"))
        except (OSError, ValueError):
            return None
        return body.get("data", {}).get("alerts", [])

    def stop(self, timeout: float = 10.0) -> None:
        for service in reversed(list(self.services.values())):
            if service.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    service.proc.send_signal(signal.SIGTERM)
        end = time.monotonic() + timeout
        for service in reversed(list(self.services.values())):
            try:
                service.proc.wait(max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    service.proc.kill()
                service.proc.wait()
        self.services.clear()
        if os.environ.get("KVCACHE_DEMO_KEEP_TMP") != "1":
            shutil.rmtree(self.workdir, ignore_errors=True)
