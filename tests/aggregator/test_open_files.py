"""1,000 replicas under a 1,024 open-file limit (issue 23 item 5): `aggregate` as users run it, its
RLIMIT_NOFILE set to 1,024 (soft and hard), 20 real ZMQ publishers with a /metrics on distinct
loopback addresses and 980 configured endpoints nobody answers (their reconnects cost descriptors
too). One ZMQ context per replica ran out at 300. `make bench` runs all 1,000 as real publishers."""

import pytest

from kvcache_exporter.tools.bench_fleet import run_fleet

REPLICAS, LIVE, LIMIT = 1000, 20, 1024


def series(text: str, name: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.rpartition(" ")
            out[labels] = float(value)
    return out


@pytest.mark.timeout(240)
def test_a_thousand_replicas_fit_in_1024_open_files(tmp_path):
    got = run_fleet(REPLICAS, LIVE, LIMIT, tmp_path, settle=150.0)
    text = got["metrics"]
    assert "Too many open files" not in got["stderr"]
    assert "Traceback" not in got["stderr"]
    assert f"kvcache_fleet_replicas {float(REPLICAS)}" in text
    received = {k for k, v in series(text, "kvcache_kv_events_batches_total").items() if v > 0}
    assert len(received) == LIVE, sorted(received)[:5]
    up = series(text, "kvcache_vllm_up")
    assert sum(up.values()) == LIVE and len(up) == REPLICAS
    subscribed = {
        k: v for k, v in series(text, "kvcache_exporter_collector_success").items() if "kv_events" in k
    }
    assert len(subscribed) == REPLICAS and set(subscribed.values()) == {1.0}
    assert 0 < got["fds"] < LIMIT
