"""`kvcache-exporter serve` as a process: endpoints, TLS and basic auth, against the simulator."""

import base64
import json
import re
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import bcrypt
import pytest

from tests.conftest import free_port

CLI = [sys.executable, "-m", "kvcache_exporter"]


def wait_for(url, timeout=20.0, context=None, headers=None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            request = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(request, timeout=2, context=context) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture
def processes(services):
    return services  # tests/conftest.py: every process stops (its whole group) after the test


def start(processes, *args):
    """`kvcache-exporter <args>`; each test waits for what it needs itself."""
    return processes.start(args[0], [*CLI, *args], port=0, ready=None).proc


def test_serves_landing_health_ready_and_metrics(processes):
    vllm_port, port = free_port(), free_port()
    upstream = f"http://127.0.0.1:{vllm_port}/metrics"
    start(processes, "serve", "--vllm.url", upstream, "--collect.interval", "0.5s",
          "--web.listen-address", f"127.0.0.1:{port}", "--gpu.source", "none")  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    assert wait_for(base + "/healthz")[0] == 200
    assert wait_for(base + "/readyz")[0] == 503  # vLLM not up yet
    status, body = wait_for(base + "/metrics")
    assert status == 200 and "kvcache_vllm_up 0.0" in body and 'reason="connection"' in body
    assert 'collector="gpu"' not in body  # GPU telemetry switched off: no collector to read as failing
    assert "Metrics" in wait_for(base + "/")[1]
    start(processes, "simulate", "--listen", f"127.0.0.1:{vllm_port}", "--rate", "20")
    deadline = time.monotonic() + 30
    while wait_for(base + "/readyz")[0] != 200:
        assert time.monotonic() < deadline, "exporter never became ready"
        time.sleep(0.3)
    body = wait_for(base + "/metrics")[1]
    assert "kvcache_vllm_up 1.0" in body and "kvcache_blocks_capacity{" in body


def test_tls_and_basic_auth_from_a_web_config_file(processes, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)  # fmt: skip
    hashed = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=4)).decode()
    web_config = tmp_path / "web.yaml"
    web_config.write_text(
        f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\nbasic_auth_users:\n  prom: '{hashed}'\n"
    )
    port = free_port()
    start(processes, "serve", "--vllm.url", "http://127.0.0.1:1/metrics", "--web.config.file",
          str(web_config), "--web.listen-address", f"127.0.0.1:{port}", "--gpu.source", "none")  # fmt: skip
    context = ssl.create_default_context(cafile=str(cert))
    context.check_hostname = False
    url = f"https://127.0.0.1:{port}/metrics"
    assert wait_for(url, context=context)[0] == 401
    wrong = {"Authorization": "Basic " + base64.b64encode(b"prom:nope").decode()}
    assert wait_for(url, context=context, headers=wrong)[0] == 401
    right = {"Authorization": "Basic " + base64.b64encode(b"prom:hunter2").decode()}
    status, body = wait_for(url, context=context, headers=right)
    assert status == 200 and "kvcache_exporter_build_info" in body
    base = f"https://127.0.0.1:{port}"  # kubelet probes carry no credentials
    assert wait_for(base + "/healthz", context=context)[0] == 200
    assert wait_for(base + "/readyz", context=context)[0] == 503  # unauthenticated, and honest: no vLLM
    assert wait_for(base + "/", context=context)[0] == 401
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plain HTTP is refused on a TLS port
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def scrape(url):
    from prometheus_client.parser import text_string_to_metric_families

    text = wait_for(url)[1]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def post(url, body):
    request = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.status


def until(check, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return result


def test_simulator_faults_restart_and_malformed_body(processes):
    sim_port, port = free_port(), free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    start(processes, "simulate", "--listen", f"127.0.0.1:{sim_port}", "--rate", "20", "--speed", "4")
    start(processes, "serve", "--vllm.url", f"{sim}/metrics", "--collect.interval", "0.5s",
          "--web.listen-address", f"127.0.0.1:{port}", "--gpu.source", "none")  # fmt: skip
    metrics = f"http://127.0.0.1:{port}/metrics"

    def queries():
        found = [v for (n, _), v in scrape(metrics).items() if n == "kvcache_prefix_cache_query_tokens_total"]
        return found[0] if found else None

    # well past what the simulator computes between two polls, so the reset is seen before it is outgrown
    before = until(lambda: (q := queries()) and q > 30000 and q, "traffic to build up")
    assert post(f"{sim}/control/restart", "{}") == 200
    until(lambda: (q := queries()) is not None and q < before, "the exporter to see the counter reset")
    for _ in range(6):  # through and after the restart: every ratio stays a ratio
        ratios = [v for (n, _), v in scrape(metrics).items() if n == "kvcache_prefix_cache_hit_ratio"]
        assert ratios and all(0 <= r <= 1 for r in ratios)
        time.sleep(0.5)

    assert post(f"{sim}/control/metrics", '{"malformed": true}') == 200
    samples = until(
        lambda: (s := scrape(metrics)).get(("kvcache_vllm_up", ())) == 0 and s,
        "the malformed body to be seen",
    )
    assert samples[("kvcache_exporter_errors_total", (("collector", "vllm"), ("reason", "parse_error")))] >= 1
    assert not any(n == "kvcache_prefix_cache_hit_ratio" for n, _ in samples)  # no stale numbers meanwhile
    assert post(f"{sim}/control/metrics", '{"malformed": false}') == 200
    until(lambda: scrape(metrics).get(("kvcache_vllm_up", ())) == 1, "recovery")


SETTLED = """
import gc, weakref
from kvcache_exporter.service import settle_gc
startup = [object() for _ in range(1000)]
settle_gc()
class Node: pass
node = Node(); node.me = node; alive = weakref.ref(node)
del node
gc.collect(0)
print(gc.get_freeze_count() >= 1000, gc.get_threshold()[0], alive() is None)
"""


def test_settled_gc_freezes_start_up_and_still_collects_cycles():
    """serve and aggregate call settle_gc once running (a process of their own: here it would freeze
    pytest's heap)."""
    out = subprocess.run([sys.executable, "-c", SETTLED], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "10000", "True"]


def test_the_field_that_broke_the_prefix_is_named_privately(processes, tmp_path):
    """The simulator's raw phase as real text (`User [ID:..] at <timestamp> asks about order [NO:..]:`
    in the tiny-llama tokenizer), its KV events into serve --fields.tokenizer: the prefix_diverged
    tokens are named field="id" (the user id comes first); /debug/fields, behind the same basic auth
    as /metrics, and the log show only redacted shapes."""
    tiny = str(Path(__file__).resolve().parents[1] / "fixtures" / "tiny-llama")
    hashed = bcrypt.hashpw(b"hunter2", bcrypt.gensalt(rounds=4)).decode()
    web_config = tmp_path / "web.yaml"
    web_config.write_text(f"basic_auth_users:\n  prom: '{hashed}'\n")
    sim_port, kv_port, port = free_port(), free_port(), free_port()
    serve = start(processes, "serve", "--vllm.url", f"http://127.0.0.1:{sim_port}/metrics",
                  "--collect.interval", "0.5s", "--web.listen-address", f"127.0.0.1:{port}",
                  "--gpu.source", "none", "--kv-events.endpoint", f"tcp://127.0.0.1:{kv_port}",
                  "--fields.tokenizer", tiny, "--fields.debug-endpoint", "true",
                  "--web.config.file", str(web_config))  # fmt: skip
    start(processes, "simulate", "--listen", f"127.0.0.1:{sim_port}", "--rate", "20", "--speed", "4",
          "--workload", "raw", "--tokenizer", tiny,
          "--kv-events-endpoint", f"tcp://127.0.0.1:{kv_port}")  # fmt: skip
    right = {"Authorization": "Basic " + base64.b64encode(b"prom:hunter2").decode()}
    base = f"http://127.0.0.1:{port}"

    def named():
        body = wait_for(base + "/metrics", headers=right)[1]
        found = re.search(r'kvcache_prefix_diverged_field_tokens_total\{field="id"\} (\S+)', body)
        return found and float(found.group(1)) > 0 and body

    body = until(named, 'field="id" tokens', timeout=60)
    diverged = float(re.search(r'miss_tokens_total\{cause="prefix_diverged"\} (\S+)', body).group(1))
    fields = dict(re.findall(r'field_tokens_total\{field="(\w+)"\} (\S+)', body))
    assert float(fields["id"]) == max(map(float, fields.values())) and float(fields["id"]) <= diverged
    assert wait_for(base + "/debug/fields")[0] == 401
    status, page = wait_for(base + "/debug/fields", headers=right)
    report = json.loads(page)["0"]
    assert status == 200 and report["fields"]["id"] > 0 and report["recent"]
    assert all(seen["shape"].startswith("<Word> <id>") for seen in report["recent"]), report["recent"]
    log = serve_log(processes, serve)
    assert 'msg="prefix diverged at a per-request field" field=id' in log
    samples = "\n".join(line for line in body.splitlines() if not line.startswith("#"))  # not the help
    for text in (page, log, samples):
        # the header's words (not inside a name: kvcache_..._reordered_estimate) and its seconds
        assert not re.search(r"\b(User|asks|order)\b|\[ID:\d|:00 ", text)


def serve_log(processes, proc) -> str:
    return next(s.log_path.read_text() for s in processes.started if s.proc is proc)
