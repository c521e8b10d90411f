"""`kvcache-exporter demo --fleet`: a simulated pool of 4 replicas serving multi-turn chats, routed
round-robin, then by session; the aggregator's view of it, one line per refresh (docs/fleet.md).
`--fleet.transport nats`: each replica's `serve --fleet.publish` sidecar publishes to a nats-server
(JetStream) the demo starts, and the aggregator reads it as `aggregate --fleet.source` does."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import signal
import sys
import tempfile
import time
from pathlib import Path

from .. import catalog as c
from ..aggregator.cli import build
from ..aggregator.discovery import FileSd
from ..aggregator.pool import Aggregator, PoolSettings
from ..config import resolve_aggregate
from ..samples import Sample
from ..simulator import EngineConfig, SimulatorConfig
from ..simulator.fleet import SimulatorFleet
from . import stack as stack_mod

REPLICAS = 4
POOL = "demo"  # the NATS subjects' pool (--fleet.transport nats)
PHASES = (
    ("round-robin", "every turn of a chat lands on the next replica, which recomputes the history"),
    ("session", "each chat sticks to one replica (hash of its session): the history is a hit"),
)


def run(args: argparse.Namespace) -> int:
    if args.fleet_transport == "nats" and (missing := nats_missing()):
        print(f"demo: --fleet.transport nats needs {missing}", file=sys.stderr)
        return 1
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_run(args))
    except RuntimeError as err:  # a sidecar or nats-server that did not come up: its log tail
        print(f"demo: {err}", file=sys.stderr)
        return 1
    return 0


def nats_missing() -> str | None:
    """What to install for the NATS transport, or None when it is all there."""
    if stack_mod.which(("nats-server",)) is None:
        return "nats-server on PATH (Debian: apt-get install nats-server; or https://nats.io/download)"
    if importlib.util.find_spec("nats") is None:
        return "the fleet extra: pip install 'kvcache-exporter[fleet]'"
    return None


async def _run(args: argparse.Namespace) -> None:
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    engine = EngineConfig(block_size=args.block_size, num_gpu_blocks=args.num_gpu_blocks)
    config = SimulatorConfig(engine=engine, schedule="chat", rate=max(args.rate, 20.0), speed=args.speed)
    window = float(max(3, int(args.phase_seconds // 3)))
    async with contextlib.AsyncExitStack() as cleanup:  # undone in reverse, however the demo stops
        tmp = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvcache-fleet-demo-")))
        sd = str(tmp / "pool.json")
        nats = args.fleet_transport == "nats"
        fleet = await SimulatorFleet(config, REPLICAS, PHASES[0][0], sd).start(load=not nats)
        cleanup.push_async_callback(fleet.stop)
        if nats:
            stack = stack_mod.Stack()
            # sidecars, then nats-server; its JetStream store goes with the stack's temp dir
            cleanup.push_async_callback(asyncio.to_thread, stack.stop)
            aggregator = await _on_nats(stack, fleet, window)
        else:
            aggregator = Aggregator(PoolSettings(windows=(window,), interval=1.0), [FileSd(sd, None)])
        cleanup.push_async_callback(aggregator.close)
        if aggregator.intake is not None:
            await aggregator.intake.start()
            fleet.start_load()  # once every sidecar follows its replica's KV events
        print(f"demo --fleet: {REPLICAS} replicas behind a gateway on {fleet.url}, chat workload")
        await _loop(args, fleet, aggregator, window, stop)


async def _on_nats(stack: stack_mod.Stack, fleet: SimulatorFleet, window: float) -> Aggregator:
    """nats-server, a `serve --fleet.publish` sidecar per replica, and the aggregator built as
    `aggregate --fleet.source` builds it (docs/fleet.md, "On NATS")."""
    nats = await asyncio.to_thread(stack.start_nats, stack_mod.which(("nats-server",)) or "nats-server")
    print(f"demo --fleet: nats-server (JetStream) on {nats.url}, store in {stack.workdir}", flush=True)

    def sidecar(index: int, name: str) -> stack_mod.Service:
        replica = fleet.replicas[index]
        metrics = f"http://{replica.config.host}:{replica.port}/metrics"
        return stack.start_sidecar(name, metrics, fleet.kv_endpoint(index), nats.url, POOL)

    await asyncio.gather(*(asyncio.to_thread(sidecar, i, n) for i, n in enumerate(fleet.names())))
    print(f"demo --fleet: {REPLICAS} sidecars publish to pool {POOL!r}; the aggregator reads it", flush=True)
    flags = {
        "fleet.source": nats.url,
        "fleet.pool": POOL,
        "collect.interval": "1s",
        "collect.windows": [f"{window:g}s"],
        "fleet.retention": "1h",
        "fleet.max_bytes": "256MiB",
    }
    return build(resolve_aggregate(flags, {}, None))


async def _loop(
    args, fleet: SimulatorFleet, aggregator: Aggregator, window: float, stop: asyncio.Event
) -> None:
    started, shown, phase, before = time.monotonic(), 0.0, -1, (0.0, 0.0)
    while not stop.is_set():
        elapsed = time.monotonic() - started
        if args.duration is not None and elapsed >= args.duration:
            break
        index = min(int(elapsed // args.phase_seconds), len(PHASES) - 1)
        if index != phase:
            if phase >= 0:
                print(residency(aggregator.latest), flush=True)
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
    print(residency(aggregator.latest), flush=True)


def residency(samples: list[Sample]) -> str:
    """The blocks each replica holds, as the fleet view counts them."""
    held = sorted((s.labels["replica"], s.value) for s in samples if s.name == c.FLEET_RESIDENT_BLOCKS)
    return "resident blocks: " + (", ".join(f"{name} {value:.0f}" for name, value in held) or "none yet")


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
