"""`make soak`: the exporter beside the simulator for an hour or more, KV events on, scraped every
second, with the default windows; its RSS is sampled until the longest window is full and after.

The claim it checks: memory plateaus once the longest window (1 h) holds a full history and the
attribution memory (sized 10x the simulator's 2,048 blocks, the documented rule) is full; a leak
shows as a slope after that point. Writes docs/soak.md (the curve as a table and an SVG).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from .. import catalog as c
from .harness import Services, free_ports

FINAL_SERIES = (
    c.KV_EVENTS_BATCHES_TOTAL,
    c.KV_EVENTS_MISSED_BATCHES_TOTAL,
    c.KV_EVENTS_CACHED_BLOCKS,
    c.PREFIX_CACHE_HIT_RATIO + "{",
    c.EXPORTER_ERRORS_TOTAL,
    c.PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED,
)
TRACKED_BLOCKS = c.PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED + '{kind="blocks"} '
MAX_TRACKED_BLOCKS = 20_480  # 10x the simulator's --num-gpu-blocks default
Point = tuple[float, float, float, int, int]  # seconds, RSS MiB, CPU s, failed scrapes, tracked blocks


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime in clock ticks (USER_HZ=100)


class Scraper(threading.Thread):
    """Prometheus's part: one GET of /metrics a second, counting answers and failures."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.ok, self.failed, self.slowest, self.tracked = url, 0, 0, 0.0, 0
        self.body = ""  # the last page answered
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(1.0):
            started = time.monotonic()
            try:
                body = urllib.request.urlopen(self.url, timeout=10).read().decode()
                self.ok, self.body = self.ok + 1, body
                line = next((x for x in body.splitlines() if x.startswith(TRACKED_BLOCKS)), None)
                self.tracked = int(float(line.split()[-1])) if line else self.tracked
            except OSError:
                self.failed += 1
            self.slowest = max(self.slowest, time.monotonic() - started)


def soak(seconds: float, sample_every: float, out_dir: Path) -> list[Point]:
    sim_port, zmq_port = free_ports(2)
    points: list[Point] = []
    with Services(out_dir / "logs") as services:
        # The exporter binds, the simulator's PUB connects to it, as vLLM's does to a concrete address.
        exporter = services.exporter(
            "--vllm.url", f"http://127.0.0.1:{sim_port}/metrics", "--gpu.source", "none",
            "--kv-events.endpoint", f"tcp://127.0.0.1:{zmq_port}", "--kv-events.mode", "bind",
            "--kv-events.max-tracked-blocks", str(MAX_TRACKED_BLOCKS),
            "--kv-events.max-fingerprints", str(2 * MAX_TRACKED_BLOCKS), timeout=60,
        )  # fmt: skip
        simulator = services.simulator(
            "--workload", "normalized:600s,chat:600s,raw:300s,normalized", "--rate", "4",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{zmq_port}", port=sim_port, timeout=60,
        )  # fmt: skip
        scraper = Scraper(f"{exporter.url}/metrics")
        try:
            scraper.start()
            started = time.monotonic()
            while (elapsed := time.monotonic() - started) <= seconds:
                if exporter.proc.poll() is not None or simulator.proc.poll() is not None:
                    raise RuntimeError(f"a process died during the soak; see {services.workdir}")
                pid = exporter.proc.pid
                points.append((elapsed, rss_mib(pid), cpu_seconds(pid), scraper.failed, scraper.tracked))
                time.sleep(sample_every)
            final = urllib.request.urlopen(scraper.url, timeout=10).read().decode()
            (out_dir / "final.prom").write_text(final)
        finally:
            scraper.stop.set()
    print(f"scrapes answered {scraper.ok}, failed {scraper.failed}, slowest {scraper.slowest:.3f}s")
    return points


def svg(points: list[Point], window_s: float) -> str:
    width, height, pad = 640, 240, 40
    t_max = max(p[0] for p in points) or 1.0
    r_max = max(p[1] for p in points) * 1.1

    def xy(t: float, r: float) -> str:
        return (
            f"{pad + t / t_max * (width - 2 * pad):.1f},{height - pad - r / r_max * (height - 2 * pad):.1f}"
        )

    line = " ".join(xy(t, r) for t, r, *_ in points)
    mark = pad + min(window_s / t_max, 1.0) * (width - 2 * pad)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-size="11">'
        f'<rect width="{width}" height="{height}" fill="white"/>'
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>'
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>'
        f'<line x1="{mark:.1f}" y1="{pad}" x2="{mark:.1f}" y2="{height - pad}" stroke="grey" '
        f'stroke-dasharray="4"/><text x="{mark + 4:.1f}" y="{pad + 10}">longest window full</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{line}"/>'
        f'<text x="{pad}" y="{pad - 8}">exporter RSS (MiB, max {r_max / 1.1:.1f})</text>'
        f'<text x="{width - pad - 80}" y="{height - pad + 16}">{t_max / 60:.0f} min</text></svg>\n'
    )


def report(points: list[Point], window_s: float) -> str:
    # The attribution memory is full when it first drops its older half (tracked blocks fall).
    full_s = next((t for (t, *_, n), (*_, m) in zip(points[1:], points, strict=False) if n < m), None)
    settled = max(window_s, full_s if full_s is not None else float("inf"))
    before = [r for t, r, *_ in points if t < settled]
    after = [(t, r) for t, r, *_ in points if t >= settled]
    lines = [
        "# Soak: RSS over time",
        "",
        "Generated by `make soak` (`python -m kvcache_exporter.tools.soak`): the simulator (KV events on, a",
        "changing workload) polled by `serve` with the default windows (1m, 5m, 15m, 1h) at the default",
        "5 s interval, `/metrics` scraped every second, the attribution memory bounded at",
        f"{MAX_TRACKED_BLOCKS:,} blocks (10x the simulator's cache). The dashed line is where the 1 h window",
        "is full; memory settles once that window and the attribution memory are both full.",
        "",
        "![RSS over time](soak.svg)",
        "",
        "The fleet view on NATS (replicas publishing through nats-server to `aggregate`, with a marked",
        "outage) has its own soak: [soak-fleet.md](soak-fleet.md) (`make soak-fleet`).",
        "",
    ]
    if after:
        first, last = after[0], after[-1]
        slope = (last[1] - first[1]) / max((last[0] - first[0]) / 3600, 1e-9)
        lines += [
            f"- RSS at start {points[0][1]:.1f} MiB; highest before both filled {max(before):.1f} MiB;",
            f"  the 1 h window and the attribution memory (its older half dropped once) both full from"
            f" minute {settled / 60:.0f};",
            f"  after both filled {min(r for _, r in after):.1f} to {max(r for _, r in after):.1f} MiB,"
            f" slope {slope:+.2f} MiB/h.",
        ]
    else:
        lines.append(
            f"- This run lasted {points[-1][0] / 60:.0f} min: the window or the memory was not full yet."
        )
    cpu = points[-1][2] / max(points[-1][0], 1e-9)
    lines += [f"- CPU: {cpu * 1000:.1f} ms per second of wall time; failed scrapes: {points[-1][3]}.", ""]
    lines += ["| minute | RSS MiB | CPU s | tracked blocks |", "|---:|---:|---:|---:|"]
    step = max(len(points) // 24, 1)
    lines += [f"| {t / 60:.0f} | {r:.1f} | {c:.1f} | {n:,} |" for t, r, c, _, n in points[::step]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5700, help="soak length (default 95 min)")
    parser.add_argument("--sample-every", type=float, default=30)
    parser.add_argument("--output", default="docs/soak.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvcache-soak-") as tmp:
        points = soak(args.seconds, args.sample_every, Path(tmp))
        final = (Path(tmp) / "final.prom").read_text().splitlines()
    seen = [line for line in final if line.startswith(FINAL_SERIES)]
    window = 3600.0
    out = Path(args.output)
    out.write_text(report(points, window) + "\nAt the end:\n\n```\n" + "\n".join(seen) + "\n```\n")
    out.with_suffix(".svg").write_text(svg(points, window))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
