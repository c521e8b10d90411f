"""Every dashboard query parses in a real Prometheus, and returns data once Prometheus has scraped
the exporter and the simulator for ~30 s (the demo stack, minus Grafana)."""

from __future__ import annotations

import time

import pytest
from dashboard_harness import ROOT, all_queries, prometheus

from kvcache_exporter.tools.harness import CLI, Services, free_port

pytestmark = pytest.mark.prometheus
RUN_S = 30

# Panels that legitimately show no data in a 30 s run. Keep it short, say why.
NO_DATA_EXPECTED = {
    # Needs an alert firing; the run is healthy on purpose.
    ("kvcache-overview", "Firing KV cache alerts"),
    # Per-process memory comes from NVML only; the run uses the DCGM source (no GPU here).
    ("kvcache-gpu-cost", "GPU memory per process"),
    # The fleet on NATS JetStream: this stack runs the direct ZMQ fan-in; the series are read from a
    # real nats-server in tests/aggregator/test_nats_intake.py and tests/core/test_fleet_publish.py.
    ("kvcache-fleet", "On NATS JetStream: sidecars publishing"),
    ("kvcache-fleet", "On NATS JetStream: shards consuming"),
}

SCRAPE = """
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: {rules}
scrape_configs:
  - job_name: kvcache-exporter
    static_configs: [{{targets: ["127.0.0.1:{exporter}"]}}]
  - job_name: vllm
    static_configs: [{{targets: ["127.0.0.1:{vllm}"]}}]
  - job_name: kvcache-aggregator
    static_configs: [{{targets: ["127.0.0.1:{aggregator}"]}}]
"""


def test_every_query_parses(tmp_path):
    config = SCRAPE.format(rules="[]", exporter=free_port(), vllm=free_port(), aggregator=free_port())
    with prometheus(tmp_path, config) as prom:
        errors = []
        for uid, where, expr in all_queries():
            answer = prom.api("query", query=expr)
            if answer["status"] != "success":
                errors.append(f"{uid} / {where}: {answer.get('error')}\n    {expr}")
        assert errors == []


def test_no_data_allow_list_names_real_panels():
    assert {(uid, where) for uid, where, _ in all_queries()} >= NO_DATA_EXPECTED


def test_parse_check_can_fail(tmp_path):
    with prometheus(tmp_path, SCRAPE.format(rules="[]", exporter=1, vllm=2, aggregator=3)) as prom:
        assert prom.api("query", query="sum by (x (up)")["errorType"] == "bad_data"


@pytest.mark.slow
def test_every_panel_has_data_from_the_demo_stack(tmp_path):
    sim, zmq = free_port(), free_port()
    rules = sorted(str(p) for p in (ROOT / "alerts" / "rules").glob("*.yaml"))
    with Services(tmp_path) as services:
        # the exporter binds the KV-event socket first; the simulator's PUB connects to it
        exporter = services.exporter(
            "--vllm.url", f"http://127.0.0.1:{sim}/metrics",
            "--gpu.source", "dcgm", "--gpu.dcgm-url", f"http://127.0.0.1:{sim}/dcgm/metrics",
            "--gpu.pod", "vllm-0", "--gpu.namespace", "default",  # the simulator's dcgm-exporter pod
            "--collect.interval", "1s",
            "--cost.gpu-hour-price", "2.5", "--cost.energy-price-per-kwh", "0.2",
            "--kv-events.endpoint", f"tcp://127.0.0.1:{zmq}", "--kv-events.mode", "bind",
            "--whatif.host-tier-bytes", "64GiB",  # the host-tier what-if panels
        )  # fmt: skip
        simulator = services.simulator(
            "--speed=2", "--kv-cache-metrics", f"--kv-events-endpoint=tcp://127.0.0.1:{zmq}", port=sim
        )
        # the Fleet row: a 2-replica simulated pool behind its gateway, and the aggregator watching it
        sd, gateway, agg = tmp_path / "pool.json", free_port(), free_port()
        pool = [*CLI, "simulate", "--replicas=2", f"--listen=127.0.0.1:{gateway}", "--workload=chat"]
        pool += ["--speed=2", f"--file-sd={sd}", "--session-ids"]
        services.start("pool", pool, gateway, "/control/state")
        aggregate = [*CLI, "aggregate", f"--discovery.file-sd={sd}", f"--web.listen-address=127.0.0.1:{agg}"]
        aggregator = services.start("aggregator", [*aggregate, "--collect.interval=1s"], agg, "/metrics")
        config = SCRAPE.format(rules=rules or "[]", exporter=exporter.port, vllm=sim, aggregator=agg)
        with prometheus(tmp_path, config) as prom:
            start = time.time()
            time.sleep(RUN_S)
            assert all(s.proc.poll() is None for s in (exporter, simulator, aggregator))
            empty = []
            for uid, where, expr in all_queries():
                answer = prom.api("query_range", query=expr, start=str(start), end=str(time.time()), step="1")
                assert answer["status"] == "success", (uid, where, expr, answer)
                if not answer["data"]["result"] and (uid, where) not in NO_DATA_EXPECTED:
                    empty.append(f"{uid} / {where}: {expr}")
    assert empty == [], "queries without data:\n" + "\n".join(empty)
