"""`make bench`, the engines' part: miss attribution of one traffic in vLLM's and in SGLang's wire shape
(simulator/streams.py: the same requests through the same engine model, published as vLLM 0.32
publishes them and as SGLang 0.5.23 does: sources/engine_events.py's rules on, HiCache's model on),
measured as `serve` runs it (decode with token ids + the engine's checks + cursor + event view + group
model + attribution, one poll's drain at a time), with and without a host tier. The two shapes run in
turn, pass after pass, and each figure is the shortest CPU time of one pass, so load on the machine
falls on both alike. `python -m kvcache_exporter.tools.bench_engines` prints them alone."""

from __future__ import annotations

import time

from ..derive.attribution import Attribution
from ..derive.kv_events import EventState
from ..derive.miss_windows import MissHistory
from ..derive.state import KvEventsState
from ..derive.units import UnitView
from ..simulator.streams import shape_frames
from ..sources.engine_events import decode_engine_message
from ..sources.kv_events_decode import KvEventDrain
from .bench_attribution import serve_gc
from .bench_side_by_side import cpu

ENGINES = ("vllm", "sglang")


def attribute(frames: list[list[bytes]], engine: str) -> None:
    drain = KvEventDrain(tuple(decode_engine_message(message, True, engine) for message in frames))
    units = UnitView(sessions_compute=engine == "sglang")
    KvEventsState(EventState(), {}, Attribution(), MissHistory(1e9), units).ingest(drain, 0.0)


def fastest_passes(streams: dict[str, list[list[bytes]]], seconds: float) -> dict[str, float]:
    """engine -> the shortest CPU seconds of one pass over its stream, the engines in turn."""
    best = dict.fromkeys(streams, float("inf"))
    end = time.process_time() + seconds
    while time.process_time() < end:
        for engine, frames in streams.items():
            start = time.process_time()
            attribute(frames, engine)
            best[engine] = min(best[engine], time.process_time() - start)
    return best


def rows(seconds: float = 6.0) -> list[tuple[str, str]]:
    out = []
    for tier in (0, 512):
        streams = {e: shape_frames(requests=400, offload_cpu_blocks=tier, engine_kind=e) for e in ENGINES}
        with serve_gc():
            best = fastest_passes(streams, seconds)
        where = f", a host tier of {tier} blocks (HiCache CPU_PINNED / vLLM CPU)" if tier else ""
        out.append(
            (
                f"miss attribution, SGLang- vs vLLM-shaped events of one traffic (400 requests{where})",
                f"SGLang {best['sglang'] * 1e3:.1f} ms a pass vs vLLM {best['vllm'] * 1e3:.1f} ms: "
                f"{best['sglang'] / best['vllm']:.2f}x (target <= 1.2x), same run, in turn",
            )
        )
    return out


def main() -> int:
    print(f"CPU: {cpu()}")
    for what, figure in rows():
        print(f"- {what}: {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
