"""`make bench` rows for the analyzer: a generated production day of block hashes, and token-id traces.

The baseline is a plain single-LRU replay of the same trace at the same vLLM block size, written as simply
as possible (an OrderedDict of blocks, capacity num_gpu_blocks - 1): what anyone would write first.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from ..analyzer import blocktrace, hitunit, mrc
from ..analyzer.replay import concurrent_replay

DAY_REQUESTS, BLOCK_SIZE, NUM_GPU_BLOCKS = 12_000, 16, 65_536


def production_day(requests: int = DAY_REQUESTS, seed: int = 12) -> list[str]:
    """Mooncake lines: ~24 blocks of 512 tokens each (145M prompt tokens), about 40 % of them reused."""
    rng = random.Random(seed)
    templates = [[rng.randrange(1 << 40) for _ in range(rng.randint(4, 40))] for _ in range(600)]
    lines = []
    for i in range(requests):
        length = rng.randint(8, 40)
        shared = rng.choice(templates)[: rng.randint(length // 3, length)] if rng.random() < 0.85 else []
        ids = shared + [rng.randrange(1 << 40) for _ in range(length - len(shared))]
        tokens = length * 512 - rng.randint(0, 511)
        lines.append(
            json.dumps({"timestamp": i * 7200, "input_length": tokens, "output_length": 200, "hash_ids": ids})
        )
    return lines


def plain_lru(lines: list[str], block_size: int, capacity: int) -> float:
    """The baseline: one OrderedDict of (hash id, sub-block) keys, front evicted first."""
    cache: OrderedDict = OrderedDict()
    hits = total = 0
    per_hash = 512 // block_size
    for line in lines:
        obj = json.loads(line)
        total += obj["input_length"]
        keys = [(h, j) for h in obj["hash_ids"] for j in range(per_hash)]
        keys = keys[: obj["input_length"] // block_size]
        hitting = True
        for key in keys:
            if hitting and key in cache:
                hits += block_size
                cache.move_to_end(key)
            else:
                hitting = False
                cache[key] = True
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits / total


def _seconds(fn) -> tuple[float, object]:
    start = time.process_time()
    value = fn()
    return time.process_time() - start, value


def day_rows() -> list[tuple[str, str]]:
    lines = production_day()

    def report():
        parsed = blocktrace.parse_lines(lines, "day", BLOCK_SIZE)
        hitunit.unit_rows(parsed.requests, [], BLOCK_SIZE, blocktrace.MOONCAKE_BLOCK)
        return mrc.stack_curve(parsed.requests, BLOCK_SIZE, NUM_GPU_BLOCKS)

    def arrivals():
        parsed = blocktrace.parse_lines(lines, "day", BLOCK_SIZE)
        return concurrent_replay(parsed.requests, BLOCK_SIZE, NUM_GPU_BLOCKS, speed=1.0)

    ours, curve = _seconds(report)
    base, base_ratio = _seconds(lambda: plain_lru(lines, BLOCK_SIZE, NUM_GPU_BLOCKS - 1))
    overlap, replayed = _seconds(arrivals)
    tokens = curve.prompt_tokens
    return [
        (
            "analyzer: production-day trace",
            f"{DAY_REQUESTS:,} Mooncake requests, {tokens / 1e6:.0f}M prompt tokens, 512-token hash blocks, "
            f"unbounded hit ratio {curve.ratio(curve.unbounded_hit_tokens):.3f}; block size {BLOCK_SIZE}, "
            f"{NUM_GPU_BLOCKS:,} blocks",
        ),
        (
            "analyzer: default report (parse, observed, unbounded, curve of "
            f"{len(curve.sizes)} sizes, causes, hit-unit rows)",
            f"{ours:.2f} s (target <= 10 s); observed hit ratio {curve.ratio(curve.observed_hit_tokens):.3f}",
        ),
        (
            "baseline: plain single-LRU replay, same trace and block size, one size",
            f"{base:.2f} s, hit ratio {base_ratio:.3f}; report / baseline = {ours / base:.2f} (target <= 6)",
        ),
        (
            "analyzer: the same day with --arrivals (open loop at its timestamps, x1): parse, engine replay",
            f"{overlap:.2f} s, observed hit ratio {replayed.hit_ratio:.3f}, {replayed.preemptions} "
            f"preemptions (baseline, the sequential report above: {ours:.2f} s, observed "
            f"{curve.ratio(curve.observed_hit_tokens):.3f}; {overlap / ours:.1f}x its time)",
        ),
    ]


MEMORY_CHILD = """
import sys
from pathlib import Path
from kvcache_exporter.analyzer import blocktrace, mrc
from kvcache_exporter.tools.bench_analyzer import BLOCK_SIZE, NUM_GPU_BLOCKS
lines = Path(sys.argv[1]).read_text().splitlines()
if sys.argv[2] == "report":
    parsed = blocktrace.parse_lines(lines, "day", BLOCK_SIZE)
    mrc.stack_curve(parsed.requests, BLOCK_SIZE, NUM_GPU_BLOCKS)
# VmHWM, not ru_maxrss: Linux carries ru_maxrss over from the parent across fork and exec.
status = Path("/proc/self/status").read_text()
print(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:")))
"""


def memory_row() -> tuple[str, str]:
    """Peak RSS of a child that reads the day and runs the default report, beside one that only reads it."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "day.jsonl"
        path.write_text("\n".join(production_day()) + "\n")

        def peak_mib(what: str) -> float:
            argv = [sys.executable, "-c", MEMORY_CHILD, str(path), what]
            return int(subprocess.run(argv, capture_output=True, text=True, check=True).stdout) / 1024

        read, report = peak_mib("read"), peak_mib("report")
    return (
        "analyzer: peak RSS of the production-day report (child process)",
        f"{report:.0f} MiB (baseline, a child that only reads the trace's lines: {read:.0f} MiB; 145M token "
        "ids as a Python list would be over 1 GiB)",
    )


def token_lines(requests: int = 400, seed: int = 3) -> list[str]:
    """Token-id requests: one of 20 system prompts of 2,000 tokens and 3,000 tokens of their own."""
    rng = random.Random(seed)
    systems = [[rng.randint(5, 50_000) for _ in range(2000)] for _ in range(20)]
    return [
        json.dumps(
            {
                "prompt_token_ids": rng.choice(systems) + [rng.randint(5, 50_000) for _ in range(3000)],
                "max_tokens": 16,
            }
        )
        for _ in range(requests)
    ]


def token_rows() -> list[tuple[str, str]]:
    lines = token_lines()

    def curve():
        parsed = blocktrace.parse_lines(lines, "tokens", BLOCK_SIZE)
        return mrc.stack_curve(parsed.requests, BLOCK_SIZE, 8192)

    seconds, result = _seconds(curve)
    return [
        (
            "analyzer: token-id trace, parse + curve + causes",
            f"{result.prompt_tokens / 1e6:.1f}M prompt tokens in {seconds:.2f} s = "
            f"{result.prompt_tokens / seconds / 1e6:.2f}M tokens/s (target >= 1M/s)",
        )
    ]


def rows() -> list[tuple[str, str]]:
    return [*day_rows(), memory_row(), *token_rows()]


if __name__ == "__main__":
    for name, value in rows():
        print(f"{name}: {value}")
