"""1,000 replicas under a 1,024 open-file limit (issue 23 item 5): `aggregate` as users run it, its
RLIMIT_NOFILE set to 1,024 (soft and hard), 20 real ZMQ publishers with a /metrics on distinct
loopback addresses and 980 configured endpoints nobody answers (their reconnects cost descriptors
too). One ZMQ context per replica ran out at 300. `make bench` runs all 1,000 as real publishers."""

import pytest

from kvcache_exporter.aggregator.descriptors import BASE_FDS, SCRAPE_RESERVE
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


ON_ONE_HOST, ONE_HOST_LIMIT = 300, 256


@pytest.mark.timeout(240)
def test_replicas_on_one_ip_past_the_limit_are_named_and_our_endpoint_keeps_its_descriptors(tmp_path):
    """Issue 33 item 1: on one IP address a replica costs two descriptors (a SUB socket of its own,
    the connection); past the limit ours all went to ZMQ, scrapes went unanswered and replicas
    silently delivered nothing. Now the budget subscribes what fits, names the rest fd_exhausted
    and leaves our /metrics and the polls their descriptors (300 replicas, 20 live, 256 files)."""
    got = run_fleet(ON_ONE_HOST, LIVE, ONE_HOST_LIMIT, tmp_path, settle=120.0, layout="one_ip")
    text = got["metrics"]
    fits = (ONE_HOST_LIMIT - BASE_FDS - SCRAPE_RESERVE - 1) // 2  # IP /metrics URLs: a poll costs 1
    assert "Too many open files" not in got["stderr"] and "Traceback" not in got["stderr"]
    assert got["stderr"].count("not subscribed (fd_exhausted)") == 1
    refused = {k for k in series(text, "kvcache_exporter_errors_total") if 'reason="fd_exhausted"' in k}
    assert len(refused) == ON_ONE_HOST - fits and all('collector="kv_events"' in k for k in refused)
    received = {k for k, v in series(text, "kvcache_kv_events_batches_total").items() if v > 0}
    assert len(received) == LIVE  # the live replicas sort first: all subscribed
    up = series(text, "kvcache_vllm_up")
    assert sum(up.values()) == LIVE and len(up) == ON_ONE_HOST
    rejected = series(text, "kvcache_exporter_http_rejected_total")
    assert not any(v for k, v in rejected.items() if "too_many_connections" in k)  # accept never failed
    assert got["answered"] > 0 and 0 < got["fds"] < ONE_HOST_LIMIT
