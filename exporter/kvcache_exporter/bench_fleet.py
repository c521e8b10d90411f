"""`make bench`, the aggregator's part: ingest of 32 publishers' KV events, and RSS with full bounds.

The frames are built in vLLM 0.32's wire format by the simulator's encoder (token ids included, as
vLLM sends them), from one shared population of prefixes so replicas overlap. Ingest is what the
aggregator's subscriber threads do per message: decode, then the fleet view under its lock.
The baseline beside it is msgspec's plain decode of the same payloads.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from .aggregator.pool import Aggregator, PoolSettings
from .derive.fleet_residency import FleetResidency, HashRange
from .simulator.blocks import BlockRemoved, BlockStored
from .simulator.kv_events import encode_batch
from .sources.kv_events import KvEventSubscriber
from .sources.kv_events_decode import Dropped, decode_message

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
    ]  # fmt: skip


def live_rows(messages, seconds: float = 5.0) -> list[tuple[str, str]]:
    """The same frames over loopback ZMQ: 32 PUB sockets in a child process, the aggregator's 32
    subscriber threads here, drained into the fleet view every 0.2 s; CPU of this process only."""
    child = subprocess.Popen(
        [sys.executable, "-m", "kvcache_exporter.bench_fleet", "--publish", str(seconds)],
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
        [sys.executable, "-m", "kvcache_exporter.bench_fleet", "--rss"],
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
    from .sources.kv_events_decode import Batch, Event

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


if __name__ == "__main__":
    if "--rss" in sys.argv:
        _fill_and_report()
    elif "--publish" in sys.argv:
        _publish(float(sys.argv[-1]))
    else:
        for name, value in rows():
            print(f"{name}: {value}")
