"""`make bench`, the fleet view on NATS JetStream's part (docs/fleet.md, "On NATS"), in-process:

* Shards: a load generator stands in for N publishing sidecars (each replica stores one 16-block
  batch a simulated second, half of it a prefix every replica shares, and removes its oldest once
  it holds 256): their real publishers (`FleetPublisher.offer`, no NATS) make the stream's
  deltas, each shard is handed the deltas its subject filters match (what its consumers get from
  NATS) and applies them (`DeltaIntake.delta`: decode, checks, fleet view). After a warm-up second
  (every replica known to every shard), the CPU of each shard beside one unsharded aggregator on
  the same stream, best of rounds taken in turn, at 100, 1,000 and 10,000 replicas.
* Publish cost: serve's attribution of the real vLLM 0.32 seed frames beside the same plus the
  publisher's `offer` of that drain, in turn in the same run.
* Memory: RSS growth of a shard holding 100, 1,000 and 10,000 replicas' blocks (a quarter shared
  by all), in child processes at two sizes per replica: the slope per (replica, block) beside a
  plain dict of the same hashes (the floor of any hash map), and what is left per replica.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator

from .. import fleet_wire as wire
from ..aggregator.fleet_residency import FleetResidency, HashRange
from ..aggregator.nats_intake import DeltaIntake
from ..derive.attribution import Attribution
from ..derive.kv_events import EventState
from ..derive.miss_windows import MissHistory
from ..derive.state import KvEventsState
from ..derive.units import UnitView
from ..fleet_publish import FleetPublisher, NatsOptions
from ..sources.kv_events_decode import Batch, Event, KvEventDrain, decode_message
from .bench_attribution import seed_frames, serve_gc

POOL = "bench"
BLOCKS_PER_BATCH = 16
HELD = 256
SHARED_PREFIXES = 64


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` one token, `>` the rest."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def stream(replicas: int, seconds: int, seed: int = 7) -> list[list[tuple[str, bytes]]]:
    """The pool's deltas, second by second: what `replicas` sidecars publish."""
    rng = random.Random(seed)
    shared = [[rng.getrandbits(64) for _ in range(BLOCKS_PER_BATCH // 2)] for _ in range(SHARED_PREFIXES)]
    publishers = [
        FleetPublisher(NatsOptions("nats://unused:4222"), POOL, f"r{i}", max_buffered=1 << 30)
        for i in range(replicas)
    ]
    held: list[list[int]] = [[] for _ in range(replicas)]
    out = []
    for second in range(seconds):
        for i, publisher in enumerate(publishers):
            fresh = [rng.getrandbits(64) for _ in range(BLOCKS_PER_BATCH // 2)]
            blocks = shared[rng.randrange(SHARED_PREFIXES)] + fresh
            events = [Event("BlockStored", tuple(blocks))]
            held[i] += fresh
            if len(held[i]) > HELD:
                events.append(Event("BlockRemoved", tuple(held[i][: BLOCKS_PER_BATCH // 2])))
                del held[i][: BLOCKS_PER_BATCH // 2]
            publisher.offer(0, KvEventDrain((Batch(second, float(second), tuple(events)),)))
        out.append([(subject, payload) for subject, payload, _ in _take(publishers)])
    return out


def _take(publishers: list[FleetPublisher]):
    for publisher in publishers:
        while publisher._queue:
            yield publisher._queue.popleft()


def shard_intake(k: int, n: int, replicas: int) -> DeltaIntake:
    return DeltaIntake(FleetResidency(HashRange(1.0, k, n)), POOL, max_replicas=replicas)


def shard_messages(seconds: list[list[tuple[str, bytes]]], k: int, n: int) -> list[list[tuple[str, bytes]]]:
    filters = wire.subject_filters("kvcache", POOL, HashRange(1.0, k, n).bounds, 1.0)
    return [[m for m in second if any(matches(f, m[0]) for f in filters)] for second in seconds]


def _apply(intake: DeltaIntake, seconds: list[list[tuple[str, bytes]]]) -> float:
    start = time.process_time()
    for second in seconds:
        for subject, payload in second:
            intake.delta(subject, payload)
    return time.process_time() - start


def shard_cpu(replicas: int, seconds: int, rounds: int = 3) -> dict:
    """CPU seconds per simulated second of the unsharded aggregator and of each shard of 2 and 4."""
    full = stream(replicas, seconds + 1)
    layouts = {(k, n): shard_messages(full, k, n) for n in (1, 2, 4) for k in range(n)}
    best = {key: float("inf") for key in layouts}
    for _ in range(rounds):
        for (k, n), messages in layouts.items():
            intake = shard_intake(k, n, replicas)
            _apply(intake, messages[:1])  # warm-up: every replica known
            best[(k, n)] = min(best[(k, n)], _apply(intake, messages[1:]) / seconds)
            assert not intake.dropped, intake.dropped
    messages = {key: sum(len(s) for s in m[1:]) / seconds for key, m in layouts.items()}
    return {"cpu": best, "messages": messages}


def _attribute(frames: list[list[bytes]], publisher: FleetPublisher | None = None) -> None:
    """As serve: one poll's drain, decoded once, offered to the publisher (its tee) and attributed."""
    drain = KvEventDrain(tuple(decode_message(message, with_tokens=True) for message in frames))
    if publisher is not None:
        publisher.offer(0, drain)
        publisher._queue.clear()
        publisher._bytes = 0
    KvEventsState(EventState(), {}, Attribution(), MissHistory(1e9), UnitView()).ingest(drain, 0.0)


def publish_overhead(seconds: float = 3.0) -> tuple[float, float]:
    """Attribution of the seed frames alone, and what the publisher's offer adds to it, µs a stored
    block: the median of passes taken in turn (alone, with), the addition the median of each
    pair's difference, so load that drifts during the run weighs on both alike."""
    frames = seed_frames()
    stored = sum(
        len(e.block_hashes) for m in frames for e in decode_message(m).events if e.type == "BlockStored"
    )
    publisher = FleetPublisher(NatsOptions("nats://unused:4222"), POOL, "r0")
    alone, added = [], []
    with serve_gc():
        start = time.process_time()
        while time.process_time() - start < seconds or len(alone) < 15:
            began = time.process_time()
            _attribute(frames)
            middle = time.process_time()
            _attribute(frames, publisher)
            alone.append(middle - began)
            added.append(time.process_time() - middle - alone[-1])
    return statistics.median(alone) / stored * 1e6, statistics.median(added) / stored * 1e6


def rows(sizes: tuple[int, ...] = (100, 1_000, 10_000)) -> list[tuple[str, str]]:
    out = []
    for replicas in sizes:
        seconds = max(2, 2_000 // replicas)
        measured = shard_cpu(replicas, seconds)
        cpu, msgs = measured["cpu"], measured["messages"]
        one = cpu[(0, 1)]
        parts = []
        for n in (2, 4):
            ratios = [cpu[(k, n)] / (one / n) for k in range(n)]
            each = ", ".join(f"{r:.2f}" for r in ratios)
            parts.append(f"N={n}: largest shard {max(ratios):.2f}x of 1/N (all {each})")
        out.append(
            (
                f"fleet on NATS: a shard's CPU at {replicas:,} publishing replicas (16 blocks/s each, "
                f"{msgs[(0, 1)]:,.0f} deltas/s)",
                f"unsharded {one * 1e3:.1f} ms CPU per second of stream "
                f"({replicas * BLOCKS_PER_BATCH / one:,.0f} blocks/s per core); " + "; ".join(parts),
            )
        )
    alone, added = publish_overhead()
    out.append(
        (
            "fleet on NATS: publishing in the sidecar (real vLLM 0.32 seed frames, same run, medians)",
            f"{added:.2f} µs a stored block on top of attribution's {alone:.2f} µs ({added / alone:.0%})",
        )
    )
    for replicas, blocks in MEMORY_SHAPES:
        shard = memory_per_block(replicas, blocks, "memory")
        floor = memory_per_block(replicas, blocks, "floor")
        out.append(
            (
                f"fleet on NATS: a shard's memory at {replicas:,} replicas ({blocks:,} -> {2 * blocks:,} "
                "blocks each, a quarter shared by all)",
                f"{shard['block']:.0f} bytes per (replica, block) of RSS growth (a plain dict of the same "
                f"hashes, same run: {floor['block']:.0f}); {shard['replica'] / 1024:.1f} KiB per replica",
            )
        )
    return out


MEMORY_SHAPES = ((100, 2_048), (1_000, 256), (10_000, 32))


def memory_per_block(replicas: int, blocks: int, kind: str) -> dict[str, float]:
    """RSS growth at `blocks` and at twice that per replica, each in a child process: the slope is
    the cost of one more (replica, block), the rest the cost of a replica."""
    grown = [_child(kind, replicas, b) for b in (blocks, 2 * blocks)]
    block = (grown[1] - grown[0]) / (replicas * blocks)
    return {"block": block, "replica": (grown[0] - block * replicas * blocks) / replicas}


def _child(kind: str, replicas: int, blocks: int) -> float:
    command = [sys.executable, "-m", "kvcache_exporter.tools.bench_nats", kind, str(replicas), str(blocks)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)["bytes"]


def _replica_hashes(replicas: int, blocks: int) -> Iterator[list[int]]:
    rng = random.Random(3)
    shared = [rng.getrandbits(64) for _ in range(blocks // 4)]
    for _ in range(replicas):
        yield shared + [rng.getrandbits(64) for _ in range(blocks - len(shared))]


def _memory_child(replicas: int, blocks: int) -> None:
    """A shard's RSS growth as it takes `replicas` x `blocks` stored (its deltas made beforehand)."""
    payloads = []
    for i, own in enumerate(_replica_hashes(replicas, blocks)):
        publisher = FleetPublisher(NatsOptions("nats://unused:4222"), POOL, f"r{i}", max_buffered=1 << 30)
        publisher.offer(0, KvEventDrain((Batch(0, 0.0, (Event("BlockStored", tuple(own)),)),)))
        payloads += [(s, p) for s, p, _ in publisher._queue]
    intake = shard_intake(0, 1, replicas)
    before = _rss()
    for subject, payload in payloads:
        intake.delta(subject, payload)
    print(json.dumps({"bytes": _rss() - before}))


def _floor_child(replicas: int, blocks: int) -> None:
    """The same hashes in a plain dict (hash -> None): what any map of them costs at least."""
    before = _rss()
    kept = dict.fromkeys(h for own in _replica_hashes(replicas, blocks) for h in own)
    print(json.dumps({"bytes": _rss() - before, "distinct": len(kept)}))


def _rss() -> int:
    import gc

    gc.collect()
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["memory"]:
        _memory_child(*(int(a) for a in sys.argv[2:]))
    elif sys.argv[1:2] == ["floor"]:
        _floor_child(*(int(a) for a in sys.argv[2:]))
    else:
        for name, value in rows(tuple(int(a) for a in sys.argv[1:]) or (100, 1_000, 10_000)):
            print(f"| {name} | {value} |")
