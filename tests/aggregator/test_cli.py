"""`kvcache-exporter simulate --replicas` and `kvcache-exporter aggregate` as the processes users run."""

import socket
import subprocess
import sys

import pytest

from kvcache_exporter.tools.harness import wait_showing
from tests.conftest import free_port


def start(*args: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "kvcache_exporter", *args]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


@pytest.mark.timeout(60)
def test_aggregate_serves_the_fleet_view_of_a_simulated_pool(tmp_path):
    sd, port = tmp_path / "pool.json", free_port()
    pool = start(
        "simulate", "--replicas", "3", "--routing", "round-robin", "--file-sd", str(sd),
        "--listen", "127.0.0.1:0", "--workload", "chat", "--rate", "40", "--speed", "5",
    )  # fmt: skip
    aggregate = start(
        "aggregate", "--discovery.file-sd", str(sd), "--web.listen-address", f"127.0.0.1:{port}",
        "--collect.interval", "500ms", "--collect.windows", "1m",
    )  # fmt: skip
    try:
        text = wait_showing(f"http://127.0.0.1:{port}/metrics", "kvcache_fleet_hit_ratio_estimate{", 30)
        checked = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        for replica in ("replica-0", "replica-1", "replica-2"):
            assert f'kvcache_vllm_up{{replica="{replica}"}} 1.0' in text
        assert 'kvcache_exporter_collector_success{collector="discovery_file_sd"} 1.0' in text
    finally:
        for process in (aggregate, pool):
            process.terminate()
        for process in (aggregate, pool):
            assert process.wait(timeout=10) == 0, process.stderr.read()


def test_aggregate_without_replicas_says_how_to_name_them():
    done = subprocess.run(
        [sys.executable, "-m", "kvcache_exporter", "aggregate"], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 2 and "--discovery.file-sd" in done.stderr


def test_every_flag_has_an_environment_twin():
    import argparse

    from kvcache_exporter.aggregator import cli
    from kvcache_exporter.config import resolve_aggregate

    environ = {
        "KVCACHE_AGGREGATE_DISCOVERY_DNS": "vllm-headless:8000",
        "KVCACHE_AGGREGATE_COLLECT_INTERVAL": "2s",
        "KVCACHE_AGGREGATE_REPLICA": "a:1 b:2",
    }
    parser = argparse.ArgumentParser()
    cli.register(parser.add_subparsers())
    args = resolve_aggregate({"collect.interval": "3s"}, environ, None)
    assert (args.discovery_dns, args.collect_interval, args.replica_targets) == (
        "vllm-headless:8000",
        3.0,
        ["a:1", "b:2"],
    )
    settings, discoveries = cli.settings_from(parser.parse_args(["aggregate"]), environ)
    assert settings.interval == 2.0 and [d.name for d in discoveries] == ["discovery_static", "discovery_dns"]


def test_a_bad_web_config_or_a_taken_port_is_a_message_not_a_traceback(tmp_path):
    web_config = tmp_path / "web.yaml"
    web_config.write_text("basic_auth_users: [alice]\n")
    sd = tmp_path / "sd.json"
    sd.write_text('[{"targets": ["127.0.0.1:1"]}]')
    base = [sys.executable, "-m", "kvcache_exporter", "aggregate", "--discovery.file-sd", str(sd)]
    bad = subprocess.run(
        [*base, "--web.config.file", str(web_config)], capture_output=True, text=True, timeout=30
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert f"{web_config}:basic_auth_users: must be a mapping" in bad.stderr
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        busy = subprocess.run(
            [*base, "--web.listen-address", address], capture_output=True, text=True, timeout=30
        )
    assert busy.returncode == 2 and "Traceback" not in busy.stderr
    assert f"--web.listen-address: cannot listen on {address}" in busy.stderr


AGGREGATE = [sys.executable, "-m", "kvcache_exporter", "aggregate", "--replica", "127.0.0.1:1"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--collect.windows", ","], "--collect.windows: at least one window is needed"),
        (
            ["--web.telemetry-path", "/healthz"],
            "--web.telemetry-path: /healthz is taken by the exporter itself",
        ),
        (["--web.telemetry-path", "metrics"], "--web.telemetry-path: must start with /"),
        (["--replica.max", "-1"], "--replica.max: -1 is below 1"),
        (["--fleet.hash-sampling", "0"], "--fleet.hash-sampling: 0 keeps no hash"),
        (["--fleet.shard", "2/2"], '--fleet.shard: "2/2" is not K/N'),
        (["--replica.kv-events-port", "70000"], "--replica.kv-events-port: 70000 is not a port"),
        (["--collect.interval", "5"], "--collect.interval: 5 needs a unit"),
        (["--discovery.dns", "vllm-headless"], "--discovery.dns: want NAME:PORT"),
        (["--replica", "ftp://x:1"], "--replica: 'ftp://x:1': want host:port"),
    ],
)
def test_every_aggregate_value_is_validated_before_it_starts(args, message):
    """Issue 23 item 6: each of these was a traceback, a poll failing forever or a wrong count."""
    for check in (["--check-config"], ["--web.listen-address", f"127.0.0.1:{free_port()}"]):
        done = subprocess.run([*AGGREGATE, *args, *check], capture_output=True, text=True, timeout=30)
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"kvcache-exporter: {message}" in done.stderr and "Traceback" not in done.stderr


def test_aggregate_reports_every_problem_at_once_and_reads_a_config_file(tmp_path):
    config = tmp_path / "aggregate.yaml"
    config.write_text("replica:\n  targets: [127.0.0.1:1]\n  max: 3\nfleet:\n  shard: 0/2\n")
    ok = subprocess.run(
        [*AGGREGATE[:4], "--config.file", str(config), "--check-config"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0, ok.stderr
    config.write_text("replicas:\n  max: 3\ncollect:\n  windows: []\n")
    bad = subprocess.run(
        [*AGGREGATE, "--config.file", str(config), "--replica.max", "0", "--check-config"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert f"kvcache-exporter: {config}:replicas: unknown key (did you mean replica?)" in lines
    assert "kvcache-exporter: --replica.max: 0 is below 1" in lines
    assert "kvcache-exporter: --collect.windows: at least one window is needed" in lines
    assert len(lines) == 3, lines


def test_default_ports_are_outside_the_allocated_exporter_range():
    """Prometheus's port registry allocates 9100-9999 to exporters; aggregate used 9401 (issue 19)."""
    from kvcache_exporter.config import AGGREGATE_OPTIONS, OPTIONS

    ports = {
        int(next(o.default for o in table if o.key == "web.listen_address").rpartition(":")[2])
        for table in (OPTIONS, AGGREGATE_OPTIONS)
    }
    assert ports == {18090, 18091}
    assert not any(9100 <= port <= 9999 for port in ports)
