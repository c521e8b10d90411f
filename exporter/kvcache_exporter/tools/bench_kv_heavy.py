"""Heavy-but-valid KV-event batches (issue 23 item 1) into a real `serve` and a real `aggregate`:
how long vLLM's series go stale, how long a scrape waits, and the process's RSS. Figures only,
never asserted (tests/sources/test_kv_events_heavy.py asserts the bounds generously).

`python -m kvcache_exporter.tools.bench_kv_heavy [--batches 1 4] [--replicas 1 4] [--at-bound 200]` prints
one row per run: the probe's 14.4 MiB batches (230 BlockStored x 65,536 one-byte hashes) into serve,
one into each of N aggregator replicas, and N batches at every per-message bound (65,536 one-byte
hashes, 64 KiB each) into serve and into each of 4 aggregator replicas.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import zmq

from .harness import CLI, Services, free_port

EVENTS, HASHES = 230, 65_536  # the probe's batch: 230 BlockStored x 65,536 one-byte hashes, 14.4 MiB
_LAST_SUCCESS = re.compile(
    r'^kvcache_exporter_last_success_timestamp_seconds\{[^}]*collector="vllm"[^}]*\} (\S+)$', re.M
)
_ACCOUNTED = re.compile(
    r"^kvcache_kv_events_(?:batches_total|missed_batches_total|dropped_total)(?:\{[^}]*\})? (\S+)$", re.M
)


def heavy_batch(events: int = EVENTS, hashes: int = HASHES) -> bytes:
    """A valid vLLM 0.32 batch: `events` BlockStored of `hashes` one-byte (fixint) hashes each."""
    stored = {"type": "BlockStored", "block_hashes": [i % 128 for i in range(hashes)]}
    return msgspec.msgpack.encode([time.time(), [stored] * events, 0])


def near_limit_batch(events: int = 4096, hashes: int = 16, block_size: int = 16, seed: int = 0) -> bytes:
    """A valid batch just under every per-message bound (issue 33 item 4): `events` BlockStored of
    `hashes` 64-bit hashes and block_size x hashes token ids (Llama-2-sized ids, 3 bytes each), 3.6 MiB."""
    rng = random.Random(seed)
    stored = [
        {
            "type": "BlockStored",
            "block_hashes": [rng.getrandbits(63) for _ in range(hashes)],
            "parent_block_hash": None,
            "token_ids": [rng.randrange(32_000) for _ in range(block_size * hashes)],
            "block_size": block_size,
        }
        for _ in range(events)
    ]
    return msgspec.msgpack.encode([time.time(), stored, 0])


def publish(pub: zmq.Socket, payloads: list[bytes], first_seq: int = 0, pause_every: int = 0) -> None:
    """Each payload in order; a second's pause after every `pause_every` of them (0: none)."""
    for seq, payload in enumerate(payloads, first_seq):
        if pause_every and seq > first_seq and (seq - first_seq) % pause_every == 0:
            time.sleep(1.0)
        pub.send_multipart([b"kv", seq.to_bytes(8, "big"), payload])


@dataclass
class Watch:
    """Scrapes /metrics every `every` seconds in a thread: the longest a scrape took, the oldest
    vLLM poll a scrape showed, and the process's RSS."""

    url: str
    pid: int
    every: float = 0.1
    longest_scrape: float = 0.0
    stalest: float = 0.0
    attempts: int = 0
    served: int = 0
    peak_rss_mib: float = 0.0
    text: str = ""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.attempts += 1
            started = time.time()
            try:
                text = urllib.request.urlopen(self.url, timeout=120).read().decode()
            except OSError:
                continue
            ended = time.time()
            self.served += 1
            self.text = text
            self.longest_scrape = max(self.longest_scrape, ended - started)
            polls = [float(v) for v in _LAST_SUCCESS.findall(text)]
            if polls:
                self.stalest = max(self.stalest, ended - min(polls))
            self.peak_rss_mib = max(self.peak_rss_mib, rss_mib(self.pid))

    def accounted(self) -> float:
        return sum(float(v) for v in _ACCOUNTED.findall(self.text))


def rss_mib(pid: int, field_name: str = "VmRSS") -> float:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    match = re.search(rf"^{field_name}:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) / 1024 if match else 0.0


def settle(watch: Watch, want: float, timeout: float) -> None:
    """Until every batch sent is counted (applied, dropped or missed), then one more second."""
    deadline = time.monotonic() + timeout
    while watch.accounted() < want and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)


def run_serve(
    label: str, payloads: list[bytes], workdir: Path, interval: str = "1s", pause_every: int = 0
) -> dict:
    with Services(workdir) as services:
        simulator = services.simulator("--rate", "5")
        kv_port = free_port()
        exporter = services.exporter(
            "--vllm.url", f"http://127.0.0.1:{simulator.port}/metrics", "--gpu.source", "none",
            "--collect.interval", interval, "--kv-events.endpoint", f"tcp://127.0.0.1:{kv_port}",
        )  # fmt: skip
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.connect(f"tcp://127.0.0.1:{kv_port}")  # serve binds a concrete tcp endpoint
        time.sleep(3.0)  # the subscription reaches the publisher; a few normal polls
        before = rss_mib(exporter.proc.pid)
        with Watch(f"http://127.0.0.1:{exporter.port}/metrics", exporter.proc.pid) as watch:
            time.sleep(2.0)
            publish(pub, payloads, pause_every=pause_every)
            settle(watch, len(payloads), timeout=300)
        pub.close(linger=0)
        ctx.term()
        return row("serve", label, before, exporter.proc.pid, watch)


def run_aggregate(
    label: str, replicas: int, payloads: list[bytes], workdir: Path, interval: str = "1s"
) -> dict:
    with Services(workdir) as services:
        simulator = services.simulator("--rate", "5")
        ctx = zmq.Context()
        pubs, groups = [], []
        for i in range(replicas):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            port = pub.bind_to_random_port("tcp://127.0.0.1")  # vLLM binds; the aggregator connects
            pubs.append(pub)
            groups.append(
                {
                    "targets": [f"127.0.0.1:{simulator.port}"],
                    "labels": {"replica": f"r{i}", "kv_events_endpoint": f"tcp://127.0.0.1:{port}"},
                }
            )
        sd = workdir / "pool.json"
        sd.write_text(json.dumps(groups))
        port = free_port()
        aggregate = services.start(
            "aggregate",
            [*CLI, "aggregate", "--discovery.file-sd", str(sd), "--web.listen-address", f"127.0.0.1:{port}",
             "--collect.interval", interval, "--collect.windows", "1m"],
            port, "/metrics",
        )  # fmt: skip
        time.sleep(3.0)
        before = rss_mib(aggregate.proc.pid)
        with Watch(f"http://127.0.0.1:{port}/metrics", aggregate.proc.pid) as watch:
            time.sleep(2.0)
            for pub in pubs:
                publish(pub, payloads)
            settle(watch, replicas * len(payloads), timeout=300)
        for pub in pubs:
            pub.close(linger=0)
        ctx.term()
        return row("aggregate", label, before, aggregate.proc.pid, watch)


def row(process: str, label: str, before: float, pid: int, watch: Watch) -> dict:
    return {
        "process": process,
        "input": label,
        "vLLM series stale (s, worst)": round(watch.stalest, 1),
        "longest scrape (s)": round(watch.longest_scrape, 2),
        "scrapes served": f"{watch.served}/{watch.attempts}",
        "RSS before (MiB)": round(before, 1),
        "RSS peak (MiB)": round(max(watch.peak_rss_mib, rss_mib(pid, "VmHWM")), 1),
        "RSS after (MiB)": round(rss_mib(pid), 1),
        "dropped": dropped(watch.text),
    }


def dropped(text: str) -> dict[str, float]:
    found = re.finditer(r'^kvcache_kv_events_dropped_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)$', text, re.M)
    return {m.group(1): float(m.group(2)) for m in found if float(m.group(2))}


def rows() -> list[tuple[str, str]]:
    """`make bench`: 4 of the probe's batches into serve (refused), 20 + 20 valid batches near every
    bound into serve (issue 33), one probe batch into each of 4 aggregator replicas."""
    heavy, near = heavy_batch(), [near_limit_batch(seed=i) for i in range(40)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [
            run_serve("4 x 14.4 MiB", [heavy] * 4, Path(tmp) / "serve"),
            run_serve("20 + 20 valid x 3.6 MiB, a second apart", near, Path(tmp) / "near", pause_every=20),
            run_aggregate("4 replicas x 14.4 MiB", 4, [heavy], Path(tmp) / "aggregate"),
        ]
    return [
        (
            f"heavy KV-event batches into {r['process']} ({r['input']}), 1 s interval",
            f"vLLM series {r['vLLM series stale (s, worst)']} s old at worst, longest scrape "
            f"{r['longest scrape (s)']} s, RSS {r['RSS before (MiB)']} -> peak {r['RSS peak (MiB)']} MiB, "
            f"dropped {r['dropped']}",
        )
        for r in runs
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 4], help="heavy batches into serve")
    parser.add_argument("--replicas", type=int, nargs="*", default=[1, 4], help="replicas (one batch each)")
    parser.add_argument("--at-bound", type=int, nargs="*", default=[200], help="batches at the bounds")
    parser.add_argument("--near-limit", type=int, nargs="*", default=[20], help="valid batches a second")
    args = parser.parse_args(argv)
    heavy, at_bound = heavy_batch(), heavy_batch(1, HASHES)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n in args.near_limit:
            near = [near_limit_batch(seed=i) for i in range(2 * n)]
            show(
                run_serve(f"{n} + {n} x 3.6 MiB valid, near every bound", near, work / f"n{n}", pause_every=n)
            )
        for n in args.batches:
            show(run_serve(f"{n} x 14.4 MiB", [heavy] * n, work / f"s{n}"))
        for n in args.replicas:
            show(run_aggregate(f"{n} x 14.4 MiB", n, [heavy], work / f"a{n}"))
        for n in args.at_bound:
            show(run_serve(f"{n} x 64 KiB", [at_bound] * n, work / f"sb{n}"))
            show(run_aggregate(f"4 x {n} x 64 KiB", 4, [at_bound] * n, work / f"ab{n}"))


def show(row: dict) -> None:
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
