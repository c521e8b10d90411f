"""Issue 33's NATS surface against the processes we ship: a real `aggregate --fleet.source` reading a
real nats-server (tests/nats_server.py). Hostile deltas published straight to the pool's subjects
are dropped by reason and counted on its /metrics; NATS gone for a while never blocks /metrics, and
the deltas after it are applied; wrong credentials are one log line, not a crash or a hang.
(aggregator/nats_intake.py's own tests cover each check in-process; these cover the process.)"""

from __future__ import annotations

import asyncio
import time
import urllib.request

import msgspec
import pytest

from kvcache_exporter import fleet_wire as wire
from kvcache_exporter.fleet_publish import ensure_stream
from kvcache_exporter.tools.harness import CLI, free_port
from tests.nats_server import NatsServer
from tests.sources.kv_processes import scrape_until, value

from .test_nats_intake import POOL, raw_delta

SUBJECT = wire.delta_subject("kvcache", POOL, 5, "a")
HOSTILE = [  # (subject, payload, the reason it is dropped for; None: applied)
    (SUBJECT, b"\xc1\xff\x00", "parse_error"),
    (SUBJECT, msgspec.msgpack.encode([1, POOL, "a", 0, 5, 1, 0, -1, 1.0, 1.0, []]), "parse_error"),
    (SUBJECT, raw_delta(replica="b"), "forged"),  # a sidecar naming another replica
    (SUBJECT, raw_delta(pool="other"), "forged"),
    (wire.delta_subject("kvcache", POOL, 6, "a"), raw_delta(r=5), "forged"),  # another range's subject
    (SUBJECT, raw_delta(sampling=0.5), "sampling_mismatch"),
    (SUBJECT, raw_delta(seq=0), None),
    (SUBJECT, raw_delta(seq=0), "duplicate"),  # replayed
    (SUBJECT, raw_delta(seq=3), None),  # seqs 1 and 2 lost: missed 2
    (SUBJECT, raw_delta(seq=2), "duplicate"),  # late, out of order
    (SUBJECT, raw_delta(seq=0, epoch=0), "stale"),  # an earlier epoch after a later one
]


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(tmp_path / "jetstream").start()
    yield server
    server.stop()


def aggregate(services, url: str):
    port = free_port()
    argv = [*CLI, "aggregate", "--fleet.source", url, "--fleet.pool", POOL, "--collect.windows", "10m",
            "--collect.interval", "0.5s", "--web.listen-address", f"127.0.0.1:{port}"]  # fmt: skip
    return services.start("aggregate", argv, port, "/metrics", timeout=60)


async def publish(url: str, sends) -> None:
    import nats

    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_stream(js, wire.stream_name("kvcache", POOL), f"kvcache.{POOL}.>", 3600, 1 << 30)
        for subject, payload in sends:
            await js.publish(subject, payload)
    finally:
        await nc.close()


def timed_scrape(url: str) -> tuple[float, str]:
    started = time.monotonic()
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return time.monotonic() - started, text


@pytest.mark.timeout(240)
def test_hostile_deltas_are_counted_by_reason_and_nats_down_never_blocks_metrics(services, nats_server):
    agg = aggregate(services, nats_server.url)
    url = f"{agg.url}/metrics"
    asyncio.run(publish(nats_server.url, [(s, p) for s, p, _ in HOSTILE]))
    want: dict[str, int] = {}
    for *_, reason in HOSTILE:
        if reason:
            want[reason] = want.get(reason, 0) + 1

    def dropped(text: str) -> dict[str, float]:
        return {r: value(text, "kvcache_fleet_deltas_dropped_total", reason=r) for r in want}

    text = scrape_until(url, lambda t: dropped(t) == want and value(t, "kvcache_fleet_deltas_total") >= 2)
    assert dropped(text) == want
    assert value(text, "kvcache_fleet_deltas_total") == 2
    assert value(text, "kvcache_kv_events_missed_batches_total", replica="a") == 2
    assert value(text, "kvcache_fleet_resident_blocks", replica="b") == 0  # the forged name made no replica

    nats_server.stop()  # NATS down: every scrape still answered, and quickly
    slowest, deadline = 0.0, time.monotonic() + 15
    while time.monotonic() < deadline:
        seconds, _ = timed_scrape(url)
        slowest = max(slowest, seconds)
        time.sleep(0.5)
    assert slowest < 5.0, f"a scrape took {slowest:.1f} s while NATS was down"
    nats_server.start()  # the same port and store: the aggregator reconnects by itself
    asyncio.run(publish(nats_server.url, [(SUBJECT, raw_delta(seq=4, hashes=[7, 8]))]))
    text = scrape_until(url, lambda t: value(t, "kvcache_fleet_deltas_total") >= 3, seconds=90)
    assert value(text, "kvcache_fleet_deltas_total") == 3
    assert value(text, "kvcache_kv_events_missed_batches_total", replica="a") == 2  # nothing lost since


@pytest.mark.timeout(120)
def test_wrong_credentials_are_one_log_line_and_metrics_keep_answering(services, tmp_path):
    server = NatsServer(tmp_path / "auth", user="kv", password="right").start()
    try:
        wrong = f"nats://kv:wrong@127.0.0.1:{server.port}"
        agg = aggregate(services, wrong)
        url = f"{agg.url}/metrics"
        for _ in range(10):  # 5 s of retries
            seconds, _ = timed_scrape(url)
            assert seconds < 5.0
            time.sleep(0.5)
        assert agg.proc.poll() is None  # still running, still answering
        log = agg.log_path.read_text()
        lines = [line for line in log.splitlines() if "authorization" in line.lower()]
        assert 1 <= len(lines) <= 2, log[-2000:]  # logged once per state change, not once a retry
        assert "wrong" not in log  # the password never reaches the log
    finally:
        server.stop()
