"""`kvcache-exporter demo --fleet`: a simulated pool of 4 replicas serving multi-turn chats, routed
round-robin, then by session; the aggregator's view of it, one line per refresh (docs/fleet.md)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import tempfile
import time
from pathlib import Path

from .. import catalog as c
from ..aggregator.discovery import FileSd
from ..aggregator.pool import Aggregator, PoolSettings
from ..samples import Sample
from ..simulator import EngineConfig, SimulatorConfig
from ..simulator.fleet import SimulatorFleet

REPLICAS = 4
PHASES = (
    ("round-robin", "every turn of a chat lands on the next replica, which recomputes the history"),
    ("session", "each chat sticks to one replica (hash of its session): the history is a hit"),
)


def run(args: argparse.Namespace) -> int:
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_run(args))
    return 0


async def _run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    engine = EngineConfig(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks)
    config = SimulatorConfig(engine=engine, schedule="chat", rate=max(args.rate, 20.0), speed=args.speed)
    window = float(max(3, int(args.phase_seconds // 3)))
    with tempfile.TemporaryDirectory(prefix="kvcache-fleet-demo-") as tmp:
        sd = str(Path(tmp) / "pool.json")
        fleet = await SimulatorFleet(config, REPLICAS, PHASES[0][0], sd).start()
        aggregator = Aggregator(PoolSettings(windows=(window,), interval=1.0), [FileSd(sd, None)])
        print(f"demo --fleet: {REPLICAS} replicas behind a gateway on {fleet.url}, chat workload")
        try:
            await _loop(args, fleet, aggregator, window, stop)
        finally:
            await aggregator.close()
            await fleet.stop()


async def _loop(
    args, fleet: SimulatorFleet, aggregator: Aggregator, window: float, stop: asyncio.Event
) -> None:
    started, shown, phase, before = time.monotonic(), 0.0, -1, (0.0, 0.0)
    while not stop.is_set():
        elapsed = time.monotonic() - started
        if args.duration is not None and elapsed >= args.duration:
            return
        index = min(int(elapsed // args.phase_seconds), len(PHASES) - 1)
        if index != phase:
            phase, fleet.routing = index, PHASES[index][0]
            print(
                f"\nphase {index + 1}/{len(PHASES)}: routing {PHASES[index][0]}: {PHASES[index][1]}",
                flush=True,
            )
        await aggregator.poll_once()
        if elapsed - shown >= args.refresh:
            shown, (text, before) = elapsed, line(aggregator.latest, before)
            print(f"{elapsed:6.0f}s  {text}", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


def line(samples: list[Sample], before: tuple[float, float]) -> tuple[str, tuple[float, float]]:
    """The pool in one line: real ratio, the affinity estimate, the other_replica share of the tokens
    computed since the last line (`before`: the counters then), duplicates; and the counters now."""
    get = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in samples}
    label = next((dict(k)["window"] for n, k in get if n == c.FLEET_HIT_RATIO), "")
    real = get.get((c.FLEET_HIT_RATIO, (("window", label),)))
    estimate = get.get((c.FLEET_HIT_RATIO_ESTIMATE, (("routing", "prefix_affinity"), ("window", label))))
    other = sum(v for (n, _), v in get.items() if n == c.PREFIX_CACHE_MISS_TOKENS_TOTAL)
    stored = sum(v for (n, _), v in get.items() if n == c.FLEET_STORED_TOKENS_TOTAL)
    computed = stored - before[1]
    share = (other - before[0]) / computed if computed > 0 else None

    def pct(x: float | None) -> str:
        return "  --" if x is None else f"{x:4.0%}"

    text = (
        f"pool hit ratio ({label}) {pct(real)} | with prefix affinity {pct(estimate)} | other_replica "
        f"{pct(share)} of the tokens computed since the last line | blocks on 2+ replicas "
        f"{pct(get.get((c.FLEET_DUPLICATE_BLOCKS_RATIO, ())))}"
    )
    return text, (other, stored)
