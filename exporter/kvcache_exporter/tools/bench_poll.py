"""Where a poll's CPU goes, per target, at 1, 20 and 100 targets (issue 22).

The targets are a child process (bench_side_by_side's, the real vLLM 0.32 payload with growing
prefix-cache counters); this process polls them through the real VllmSource and poll state with
serve's default windows and quantiles, one stage at a time so each stage's CPU (process_time)
is its own: fetch (the HTTP GET of every target, concurrently, as a poll does), parse, ingest
(the history), derive (every sample of every target, the guard included) and exposition (one
scrape of /metrics per poll). `whole poll` is Exporter.poll_once, the path serve runs.

    python -m kvcache_exporter.tools.bench_poll [TARGETS...]
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

from ..exposition import registry_for, render
from ..sources.vllm import VllmSource
from . import bench_side_by_side
from .exporters import vllm_exporter
from .harness import free_ports, http_get, wait_until

STAGES = ("fetch", "parse", "ingest", "derive", "exposition")
WINDOWS, QUANTILES = (60.0, 300.0, 900.0, 3600.0), (0.5, 0.9, 0.99)  # serve's defaults


async def _stages(ports: list[int], polls: int) -> dict[str, float]:
    """CPU ms per target-poll of each stage and of the whole poll, after warm-up polls."""
    sources = [VllmSource(f"http://127.0.0.1:{port}/metrics") for port in ports]
    exporter = vllm_exporter(
        {f"127.0.0.1:{p}": s for p, s in zip(ports, sources, strict=True)},
        windows=WINDOWS,
        quantiles=QUANTILES,
        interval=1.0,
    )
    registry = registry_for(lambda: exporter.latest)
    spent = dict.fromkeys((*STAGES, "whole poll"), 0.0)
    try:
        for _ in range(5):
            await exporter.poll_once()
        for _ in range(polls):
            start = time.process_time()
            texts = await asyncio.gather(*(s.fetch() for s in sources))
            fetched = time.process_time()
            snapshots = [s.read(text) for s, text in zip(sources, texts, strict=True)]
            parsed = time.process_time()
            now = time.time()
            for poll, snapshot in zip(exporter.polls, snapshots, strict=True):
                poll.into(snapshot, now)
            exporter.state.end_poll(now)
            ingested = time.process_time()
            exporter.latest = exporter.derive()
            derived = time.process_time()
            render(registry)
            rendered = time.process_time()
            for stage, (a, b) in zip(
                STAGES, [(start, fetched), (fetched, parsed), (parsed, ingested), (ingested, derived),
                         (derived, rendered)], strict=True
            ):  # fmt: skip
                spent[stage] += b - a
        start = time.process_time()
        for _ in range(polls):
            await exporter.poll_once()
        spent["whole poll"] = time.process_time() - start
    finally:
        await exporter.close()
    return {stage: seconds / polls / len(ports) * 1000 for stage, seconds in spent.items()}


def split(targets: int, polls: int) -> dict[str, float]:
    ports = free_ports(targets)
    argv = [sys.executable, "-m", bench_side_by_side.__name__, "serve-targets", *map(str, ports)]
    with subprocess.Popen(argv) as child:
        try:
            wait_until(lambda: http_get(f"http://127.0.0.1:{ports[0]}/counts")[0] == 200, "targets")
            return asyncio.run(_stages(ports, polls))
        finally:
            child.terminate()


def rows(counts: tuple[int, ...] = (1, 20, 100), target_polls: int = 2000) -> list[tuple[str, str]]:
    out = []
    for targets in counts:
        ms = split(targets, max(target_polls // targets, 10))
        stages = ", ".join(f"{stage} {ms[stage]:.3f}" for stage in STAGES)
        out.append((
            f"one poll at {targets} target{'s' * (targets > 1)}: CPU ms per target-poll by stage",
            f"{stages}; sum {sum(ms[s] for s in STAGES):.3f}; whole poll {ms['whole poll']:.3f}",
        ))  # fmt: skip
    return out


if __name__ == "__main__":
    for row in rows(tuple(int(n) for n in sys.argv[1:]) or (1, 20, 100)):
        print(" | ".join(row))
