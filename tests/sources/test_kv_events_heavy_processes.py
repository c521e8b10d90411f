"""Heavy-but-valid KV-event batches into the processes we ship (issue 23 item 1): a real `serve`
and a real `aggregate` (4 replicas) on loopback, fed by real ZMQ publishers, polling a simulated
vLLM. While the flood lasts, every scrape is answered and shows vLLM's series fresh, RSS stays
bounded, and every batch sent is accounted for: applied, or dropped with its reason.
Bounds are generous on purpose; the figures are in `python -m kvcache_exporter.tools.bench_kv_heavy`."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from pathlib import Path

import msgspec
import pytest
import zmq

from kvcache_exporter.sources.kv_events_decode import MAX_HASHES_PER_BATCH
from kvcache_exporter.tools.harness import CLI, free_port, wait_showing

from .kv_processes import kv_serve, samples, subscribed, xpub


def batch(events: int, hashes: int) -> bytes:
    """`events` BlockStored of `hashes` one-byte hashes each, in vLLM 0.32's encoding."""
    stored = {"type": "BlockStored", "block_hashes": [i % 128 for i in range(hashes)]}
    return msgspec.msgpack.encode([1.0, [stored] * events, 0])


HEAVY = batch(230, 65_536)  # the probe's: 14.4 MiB, every event within its own bound
UNDER = batch(1, MAX_HASHES_PER_BATCH)  # at every per-message bound: 64 KiB, applied if the poll has room
ROUND = [HEAVY] + [UNDER] * 20
FRESH_SECONDS = 10.0  # a scrape whose latest vLLM poll is older than this shows stale series (interval 0.5 s)
RSS_BOUND_MIB = 200.0


def peak_rss_mib(pid: int) -> float:
    return int(re.search(r"^VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)[1]) / 1024


class Scraper(threading.Thread):
    """Scrapes every 0.25 s until stopped: attempts, answers, and answers with fresh vLLM series."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.attempts = self.served = self.fresh = 0
        self.text = ""

    def run(self) -> None:
        while not self.stop.wait(0.25):
            self.attempts += 1
            try:
                text = urllib.request.urlopen(self.url, timeout=10).read().decode()
            except OSError:
                continue
            self.served, self.text = self.served + 1, text
            polls = samples(text, "kvcache_exporter_last_success_timestamp_seconds")
            vllm = [v for labels, v in polls if labels.get("collector") == "vllm"]
            if vllm and time.time() - min(vllm) < FRESH_SECONDS:
                self.fresh += 1


def flood(pubs: list[zmq.Socket], rounds: int) -> None:
    """`rounds` times ROUND from each publisher, seqs 0, 1, ... per publisher, half a second apart."""
    for round_number in range(rounds):
        for pub in pubs:
            for i, payload in enumerate(ROUND, round_number * len(ROUND)):
                pub.send_multipart([b"kv", i.to_bytes(8, "big"), payload])
        time.sleep(0.5)


def accounted(text: str, replica: str | None = None) -> float:
    def mine(labels: dict[str, str]) -> bool:
        return replica is None or labels.get("replica") == replica

    names = (
        "kvcache_kv_events_batches_total",
        "kvcache_kv_events_dropped_total",
        "kvcache_kv_events_missed_batches_total",
    )
    return sum(v for name in names for labels, v in samples(text, name) if mine(labels))  # fmt: skip


def dropped(text: str, reason: str, replica: str | None = None) -> float:
    return sum(
        v
        for labels, v in samples(text, "kvcache_kv_events_dropped_total")
        if labels["reason"] == reason and (replica is None or labels.get("replica") == replica)
    )


def watch_flood(url: str, pubs: list[zmq.Socket], rounds: int, done) -> Scraper:
    """Flood while scraping; scrape on until every batch is accounted for (or 120 s went by)."""
    scraper = Scraper(url)
    scraper.start()
    try:
        flood(pubs, rounds)
        deadline = time.monotonic() + 120
        while not done(scraper.text) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        scraper.stop.set()
        scraper.join()
    return scraper


@pytest.mark.timeout(300)
def test_serve_stays_fresh_and_bounded_under_heavy_batches(services):
    rounds = 6
    served = kv_serve(services)
    url, kv_port, exporter = served.url, served.kv_port, served.exporter
    ctx = zmq.Context()
    pub = xpub(ctx)
    try:
        pub.connect(f"tcp://127.0.0.1:{kv_port}")  # serve binds a concrete tcp endpoint, as for vLLM
        subscribed(pub)
        sent = rounds * len(ROUND)
        scraper = watch_flood(url, [pub], rounds, lambda text: accounted(text) >= sent)
    finally:
        pub.close()
        ctx.term()
    text = scraper.text
    assert accounted(text) == sent  # nothing unaccounted, nothing counted twice
    assert dropped(text, "batch_too_heavy") == rounds
    assert dropped(text, "budget_exceeded") > 0  # 26M hashes: far more than 25% of the polls can apply
    assert samples(text, "kvcache_kv_events_missed_batches_total")[0][1] == 0
    assert scraper.served == scraper.attempts > 0
    assert scraper.fresh >= 0.9 * scraper.attempts, f"{scraper.fresh} of {scraper.attempts} scrapes fresh"
    assert peak_rss_mib(exporter.proc.pid) < RSS_BOUND_MIB


@pytest.mark.timeout(300)
def test_aggregate_of_four_replicas_stays_fresh_and_bounded_under_heavy_batches(services, tmp_path):
    rounds = 3
    simulator = services.simulator("--rate", "5")
    ctx = zmq.Context()
    pubs = [xpub(ctx) for _ in range(4)]
    try:
        groups = []
        for i, pub in enumerate(pubs):
            port = pub.bind_to_random_port("tcp://127.0.0.1")  # vLLM binds; the aggregator connects
            labels = {"replica": f"r{i}", "kv_events_endpoint": f"tcp://127.0.0.1:{port}"}
            groups.append({"targets": [f"127.0.0.1:{simulator.port}"], "labels": labels})
        sd = tmp_path / "pool.json"
        sd.write_text(json.dumps(groups))
        port = free_port()
        services.start(
            "aggregate",
            [*CLI, "aggregate", "--discovery.file-sd", str(sd), "--web.listen-address", f"127.0.0.1:{port}",
             "--collect.interval", "0.5s", "--collect.windows", "1m"],
            port, "/metrics",
        )  # fmt: skip
        aggregate = services.started[-1]
        url = f"http://127.0.0.1:{port}/metrics"
        for pub in pubs:
            subscribed(pub)
        wait_showing(url, 'kvcache_vllm_up{replica="r3"} 1.0')
        sent = rounds * len(ROUND)
        replicas = [f"r{i}" for i in range(4)]
        scraper = watch_flood(
            url, pubs, rounds, lambda text: all(accounted(text, r) >= sent for r in replicas)
        )
    finally:
        for pub in pubs:
            pub.close()
        ctx.term()
    text = scraper.text
    for replica in replicas:
        assert accounted(text, replica) == sent
        assert dropped(text, "batch_too_heavy", replica) == rounds
    assert scraper.served == scraper.attempts > 0
    assert scraper.fresh >= 0.9 * scraper.attempts, f"{scraper.fresh} of {scraper.attempts} scrapes fresh"
    assert peak_rss_mib(aggregate.proc.pid) < RSS_BOUND_MIB
