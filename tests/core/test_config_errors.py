"""Every configuration the exporter would reject is rejected by --check-config too, and both say
`location: message` (exit 2), never a traceback: through the real CLI."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

TINY_LLAMA = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama"
CLI = [sys.executable, "-m", "kvcache_exporter", "serve", "--gpu.source", "none"]


def run(*args, env=None):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60, env=env)


def assert_config_error(result, location):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert f"kvcache-exporter: {location}" in result.stderr, result.stderr


def file_with(tmp_path, name, body):
    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return str(path)


CASES = {
    "empty windows flag": (["--collect.windows", ","], "--collect.windows: at least one window"),
    "empty windows in YAML": ({"c.yaml": "collect:\n  windows: []\n"}, "--collect.windows: at least one"),
    "telemetry path /healthz": (["--web.telemetry-path", "/healthz"], "--web.telemetry-path: /healthz is"),
    "telemetry path /": (["--web.telemetry-path", "/"], "--web.telemetry-path:"),
    "dcgm without a pod": (
        ["--gpu.source", "dcgm", "--gpu.dcgm-url", "http://127.0.0.1:1/metrics"],
        "--gpu.pod: the dcgm GPU source needs",
    ),
    "non-UTF-8 YAML": ({"c.yaml": b"vllm:\n  url: [http://\xff/metrics]\n"}, "FILE: not UTF-8 text"),
    "users as a list": ({"web.yaml": "basic_auth_users: [alice]\n"}, "FILE:basic_auth_users: must be"),
    "users as a scalar file": ({"web.yaml": "alice\n"}, "FILE: top level: must be a mapping"),
    "tls as a word": (
        {"web.yaml": "tls_server_config: yes-please\n"},
        "FILE:tls_server_config: must be a mapping",
    ),
    "missing web-config file": ({"web.yaml": None}, "FILE: No such file or directory"),
    "missing cert file": (
        {"web.yaml": "tls_server_config:\n  cert_file: /nope.pem\n  key_file: /nope.pem\n"},
        "FILE:tls_server_config: No such file or directory",
    ),
    "negative count": (["--gpu.max-processes", "-1"], "--gpu.max-processes: -1 is below 0"),
    "zero event rate": (
        ["--kv-events.max-batches-per-second", "0"],
        "--kv-events.max-batches-per-second: 0 is",
    ),
    "an empty window among others": (["--collect.windows", "1m,,5m"], '--collect.windows: "1m,,5m" has an'),
    "vLLM body bound 0": (["--vllm.max-body-bytes", "0"], '--vllm.max-body-bytes: size "0" must be above 0'),
    "URL port 99999": (
        ["--vllm.url", "http://127.0.0.1:99999/metrics"],
        '--vllm.url: "http://127.0.0.1:99999',
    ),
    "garbage KV endpoint": (
        ["--kv-events.endpoint", "garbage"],
        '--kv-events.endpoint: "garbage" is not a ZMQ',
    ),
    "KV endpoint port out of range": (
        ["--kv-events.endpoint", "tcp://127.0.0.1:99999"],
        "--kv-events.endpoint:",
    ),
    "garbage replay endpoint": (["--kv-events.replay-endpoint", "tcp:/x"], "--kv-events.replay-endpoint:"),
    "10,000 ranks": (
        ["--kv-events.data-parallel-size", "10000"],
        "--kv-events.data-parallel-size: 10000 is above",
    ),
    "fractional count": (["--web.max-connections", "2.5"], '--web.max-connections: "2.5" is not a whole'),
    "invalid bcrypt hash": ({"web.yaml": "basic_auth_users:\n  a: x\n"}, "FILE:basic_auth_users.a: not"),
    "field tokenizer without KV events": (
        ["--fields.tokenizer", str(TINY_LLAMA), "--kv-events.discovery", "off"],
        "--fields.tokenizer: needs KV events: --kv-events.endpoint or discovery on",
    ),
    "missing field tokenizer": (
        ["--kv-events.endpoint", "tcp://127.0.0.1:1", "--fields.tokenizer", "/nope/tokenizer.json"],
        "--fields.tokenizer: /nope/tokenizer.json: [Errno 2] No such file",
    ),
    "backtracking field pattern": (
        ["--fields.patterns", "slow=(a+)+b"],
        "--fields.patterns: slow: a repeat inside a repeat",
    ),
    "field pattern named like a label it cannot be": (
        {"c.yaml": "fields:\n  patterns:\n    Ticket: TCK-\\d+\n"},
        "FILE:fields.patterns: Ticket: the name must match",
    ),
    "debug endpoint without a tokenizer": (
        ["--fields.debug-endpoint", "true"],
        "--fields.debug-endpoint: needs --fields.tokenizer",
    ),
    "debug endpoint not a boolean": (
        ["--fields.debug-endpoint", "maybe"],
        '--fields.debug-endpoint: "maybe" is not true or false',
    ),
}


def arguments(tmp_path, spec):
    if isinstance(spec, list):
        return spec, {}
    ((name, body),) = spec.items()
    path = str(tmp_path / name) if body is None else file_with(tmp_path, name, body)
    flag = "--web.config.file" if name == "web.yaml" else "--config.file"
    return [flag, path], {"FILE": path}


@pytest.mark.parametrize("case", CASES)
def test_check_config_and_start_reject_alike(tmp_path, case):
    spec, location = CASES[case]
    args, paths = arguments(tmp_path, spec)
    location = location.replace("FILE", paths.get("FILE", ""))
    assert_config_error(run(*args, "--check-config"), location)
    port = ["--web.listen-address", "127.0.0.1:0"]
    assert_config_error(run(*args, *port, "--vllm.url", "http://127.0.0.1:1/metrics"), location)


def test_port_in_use_is_a_config_error():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        result = run("--web.listen-address", address, "--vllm.url", "http://127.0.0.1:1/metrics")
    assert_config_error(result, f"--web.listen-address: cannot listen on {address}: ")


def test_every_problem_of_flags_environment_and_file_at_once(tmp_path):
    """Three typos, one run: one line each, then exit 2."""
    config = file_with(
        tmp_path, "c.yaml", "kv_event:\n  endpoint: tcp://127.0.0.1:5557\ncollect:\n  interval: 5\n"
    )
    env = {**__import__("os").environ, "KVCACHE_EXPORTER_VLLM_TIMEOUT": "soon"}
    result = run("--config.file", config, "--web.max-connections", "many", "--check-config", env=env)
    assert_config_error(result, f"{config}:kv_event: unknown key (did you mean kv_events?)")
    for location in (
        f"{config}:collect.interval: 5 needs a unit",
        'KVCACHE_EXPORTER_VLLM_TIMEOUT: invalid duration "soon"',
        '--web.max-connections: "many" is not a whole number',
    ):
        assert f"kvcache-exporter: {location}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 4, result.stderr


@pytest.mark.parametrize("where", ["flag", "yaml", "env"])
def test_one_duration_grammar_for_flags_yaml_and_environment(tmp_path, where):
    """`collect.interval: 5` and `--collect.interval 5` were judged apart; a bare number is refused
    wherever it comes from (is it seconds or minutes?), and `5s` accepted wherever."""
    import os

    def attempt(value):
        env = dict(os.environ)
        if where == "flag":
            return run("--collect.interval", value, "--check-config")
        if where == "env":
            return run("--check-config", env={**env, "KVCACHE_EXPORTER_COLLECT_INTERVAL": value})
        config = file_with(tmp_path, "c.yaml", f"collect:\n  interval: {value}\n")
        return run("--config.file", config, "--check-config")

    refused = attempt("5")
    assert refused.returncode == 2 and "5 needs a unit" in refused.stderr, refused.stderr
    assert attempt("5s").returncode == 0
