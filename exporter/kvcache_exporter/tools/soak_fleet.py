"""`make soak-fleet`: the fleet view on NATS for hours. Simulated replicas (KV events on), each with
its `serve --fleet.publish` sidecar, publish through a real nats-server to `aggregate --fleet.source`;
every exporter is scraped once a second and every process's RSS sampled.

The claims it checks: RSS flat once warmed up; 0 failed scrapes; every delta the sidecars published
(JetStream acked) is applied by the aggregator or dropped with a reason, and none is lost outside
the marked gap (with `--nats-outage`, nats-server is stopped for that long in the middle of the
run: what the sidecars drop then is counted, and the aggregator's missed batches must be no more).
Writes docs/soak-fleet.md.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from .. import catalog as c
from ..sources.textformat import parse_line
from .harness import CLI, Service, Services, free_port, free_ports, wait_until
from .soak import MAX_TRACKED_BLOCKS, Scraper, cpu_seconds, rss_mib

# At the soak's rate a sidecar remembers ~50 new content fingerprints a minute: a bound that fills
# within the warm-up, so RSS after it is the bounded state's, not a table still filling.
MAX_FINGERPRINTS = 2_048
TRACKED = c.PREFIX_CACHE_MISS_ATTRIBUTION_TRACKED

POOL = "soak"
# The engine shapes a replica can take: the simulator's flags, then its sidecar's.
SHAPES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "vllm": ((), ()),
    "sglang": (("--engine", "sglang"), ("--kv-events.engine", "sglang")),  # SGLang's pages and events
}


def totals(text: str, name: str, **labels: str) -> float:
    """Sum of `name`'s samples whose labels include `labels`."""
    out = 0.0
    for raw in text.splitlines():
        if raw.startswith(name) and not raw.startswith("#"):
            line = parse_line(raw)
            if line.name == name and all(line.labels.get(k) == v for k, v in labels.items()):
                out += line.value
    return out


def by_label(text: str, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for raw in text.splitlines():
        if raw.startswith(name + "{"):
            line = parse_line(raw)
            if line.name == name:
                key = line.labels.get(label, "")
                out[key] = out.get(key, 0.0) + line.value
    return out


def get(url: str) -> str:
    return urllib.request.urlopen(url, timeout=10).read().decode()


class Nats:
    """nats-server with JetStream on a fixed port and store, so it can be stopped and started again."""

    def __init__(self, store: Path, log: Path):
        self.port, self.store, self.log = free_port(), store, log
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = shutil.which("nats-server")
        if binary is None:
            raise SystemExit("nats-server is not installed (make system-deps)")
        argv = [binary, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

        def listening() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return True
            except OSError:
                return False

        wait_until(listening, "nats-server to listen", 15)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=15)
        self.proc = None


@dataclass
class Point:
    seconds: float
    rss: dict[str, float]  # process name -> MiB
    cpu: dict[str, float]  # process name -> CPU seconds
    failed: int  # failed scrapes, all exporters
    in_gap: bool
    buffered: float  # messages waiting in the sidecars' buffers for NATS, all sidecars
    pending: float  # messages JetStream holds for the aggregator and has not delivered
    tracked: dict[str, float] = field(default_factory=dict)  # kind -> the fewest any sidecar holds


@dataclass
class Run:
    points: list[Point] = field(default_factory=list)
    scrapes_ok: int = 0
    scrapes_failed: int = 0
    slowest: float = 0.0
    gap: tuple[float, float] | None = None
    sidecars: dict[str, str] = field(default_factory=dict)  # name -> final /metrics
    aggregate: str = ""
    shapes: dict[str, str] = field(default_factory=dict)
    windows: str = "1m,5m,15m,1h"  # the exporters' --collect.windows


def soak(
    seconds: float,
    every: float,
    replicas: list[str],
    outage: tuple[float, float],
    rate: float,
    out: Path,
    windows: tuple[str, ...] = (),
) -> Run:
    run = Run()
    if windows:
        run.windows = windows[1]
    nats = Nats(out / "jetstream", out / "nats.log")
    nats.start()
    try:
        with Services(out / "logs") as services:
            procs: dict[str, Service] = {}
            for i, shape in enumerate(replicas):
                name = f"{shape}-{i}"
                sim_port, zmq_port = free_ports(2)
                services.simulator(
                    *SHAPES[shape][0], "--workload", "normalized:600s,chat:600s,raw:300s,normalized",
                    "--rate", str(rate), "--kv-events-endpoint", f"tcp://127.0.0.1:{zmq_port}",
                    port=sim_port, timeout=90,
                )  # fmt: skip
                procs[name] = services.exporter(
                    "--vllm.url", f"http://127.0.0.1:{sim_port}/metrics", "--gpu.source", "none",
                    "--kv-events.endpoint", f"tcp://127.0.0.1:{zmq_port}", "--kv-events.mode", "bind",
                    "--fleet.publish", nats.url, "--fleet.pool", POOL, "--fleet.replica", name,
                    "--kv-events.max-tracked-blocks", str(MAX_TRACKED_BLOCKS),
                    "--kv-events.max-fingerprints", str(MAX_FINGERPRINTS),
                    *windows, *SHAPES[shape][1], timeout=90,
                )  # fmt: skip
                run.shapes[name] = shape
            port = free_port()
            procs["aggregate"] = services.start(
                "aggregate",
                [*CLI, "aggregate", "--fleet.source", nats.url, "--fleet.pool", POOL,
                 "--web.listen-address", f"127.0.0.1:{port}", *windows],
                port, "/metrics", timeout=90,
            )  # fmt: skip
            scrapers = [Scraper(f"{p.url}/metrics") for p in procs.values()]
            for s in scrapers:
                s.start()
            try:
                _sample(run, procs, scrapers, nats, seconds, every, outage)
                _settle(run, procs, services)
            finally:
                for s in scrapers:
                    s.stop.set()
            run.scrapes_ok = sum(s.ok for s in scrapers)
            run.scrapes_failed = sum(s.failed for s in scrapers)
            run.slowest = max(s.slowest for s in scrapers)
    finally:
        nats.stop()
    return run


def _sample(
    run: Run,
    procs: dict,
    scrapers: list,
    nats: Nats,
    seconds: float,
    every: float,
    outage: tuple[float, float],
) -> None:
    gap_at, gap_length = outage
    gap_at = gap_at if gap_length else None
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) <= seconds:
        for name, p in procs.items():
            if p.proc.poll() is not None:
                raise RuntimeError(f"{name} died during the soak; see {p.log_path}")
        if gap_at is not None and run.gap is None and elapsed >= gap_at:
            nats.stop()
            run.gap = (elapsed, elapsed + gap_length)
        if run.gap is not None and nats.proc is None and elapsed >= run.gap[1]:
            nats.start()
            run.gap = (run.gap[0], elapsed)
        in_gap = run.gap is not None and nats.proc is None
        rss = {n: rss_mib(p.proc.pid) for n, p in procs.items()}
        cpu = {n: cpu_seconds(p.proc.pid) for n, p in procs.items()}
        pages = {n: s.body for n, s in zip(procs, scrapers, strict=True)}
        buffered = sum(totals(t, c.FLEET_PUBLISH_BUFFERED) for n, t in pages.items() if n != "aggregate")
        pending = totals(pages["aggregate"], c.FLEET_CONSUMER_PENDING)
        failed = sum(s.failed for s in scrapers)
        sidecars = [t for n, t in pages.items() if n != "aggregate" and t]
        tracked = {
            kind: min((totals(t, TRACKED, kind=kind) for t in sidecars), default=0.0)
            for kind in ("blocks", "fingerprints")
        }
        run.points.append(Point(elapsed, rss, cpu, failed, in_gap, buffered, pending, tracked))
        print(
            f"{elapsed / 60:6.1f} min  " + "  ".join(f"{n} {r:.1f}" for n, r in rss.items())
            + f"  buffered {buffered:.0f} pending {pending:.0f} failed {failed}{' (gap)' if in_gap else ''}",
            flush=True,
        )  # fmt: skip
        time.sleep(every)


def _settle(run: Run, procs: dict, services: Services) -> None:
    """Stop the load (the simulators), then wait until the sidecars' buffers are empty and the
    aggregator's read count stands still, and keep the final pages."""
    for s in [s for s in services.started if s.name == "simulator"]:
        s.proc.terminate()
    sidecars = {n: p for n, p in procs.items() if n != "aggregate"}
    last = [-1.0]

    def quiet() -> bool:
        pages = {n: get(f"{p.url}/metrics") for n, p in sidecars.items()}
        agg = get(f"{procs['aggregate'].url}/metrics")
        run.sidecars, run.aggregate = pages, agg
        if any(totals(t, c.FLEET_PUBLISH_BUFFERED) for t in pages.values()):
            return False
        read = totals(agg, c.FLEET_DELTAS_TOTAL) + totals(agg, c.FLEET_DELTAS_DROPPED_TOTAL)
        still, last[0] = read == last[0], read
        return still and totals(agg, c.FLEET_CONSUMER_PENDING) == 0

    try:
        wait_until(quiet, "the aggregator to read every published delta", 120, every=5.0)
    except Exception as err:  # the report says so; the pages are the last ones read
        print(f"not settled: {err}")


def filled_at(points: list[Point]) -> float | None:
    """Seconds until the sidecars' tracked blocks were first at their bound: from then on they cycle
    between half and full. The fingerprints are several two-generation sets, each turning at its own
    share of the bound (their sum never reaches it), filled long before the blocks at the soak's rate."""
    return next(
        (p.seconds for p in points if p.tracked.get("blocks", 0.0) >= 0.95 * MAX_TRACKED_BLOCKS), None
    )


def report(run: Run, warm_up: float) -> str:
    pts = run.points
    names = list(pts[0].rss)
    full = filled_at(pts)
    warm = max(min(warm_up, pts[-1].seconds / 2), full or 0.0)
    after = [p for p in pts if p.seconds >= warm and not p.in_gap]
    published = sum(totals(t, c.FLEET_PUBLISHED_TOTAL) for t in run.sidecars.values())
    pub_dropped: dict[str, float] = {}
    for t in run.sidecars.values():
        for k, v in by_label(t, c.FLEET_PUBLISH_DROPPED_TOTAL, "reason").items():
            pub_dropped[k] = pub_dropped.get(k, 0.0) + v
    applied = totals(run.aggregate, c.FLEET_DELTAS_TOTAL)
    agg_dropped = by_label(run.aggregate, c.FLEET_DELTAS_DROPPED_TOTAL, "reason")
    missed = totals(run.aggregate, c.KV_EVENTS_MISSED_BATCHES_TOTAL)
    sidecar_missed = sum(totals(t, c.KV_EVENTS_MISSED_BATCHES_TOTAL) for t in run.sidecars.values())
    in_gap = sum(pub_dropped.values())
    shapes = ", ".join(f"{n} ({s}-shaped)" for n, s in run.shapes.items())
    filled = (
        f"the tracked blocks first at their bound (then they drop their older half) by minute {full / 60:.0f}"
        if full is not None
        else "the tracked blocks never reached their bound: RSS below is still filling"
    )
    lines = [
        "# Soak: the fleet view on NATS",
        "",
        "Generated by `make soak-fleet` (`python -m kvcache_exporter.tools.soak_fleet`): simulated replicas",
        f"({shapes}), each with `serve --fleet.publish` to one real nats-server (JetStream), read by",
        "`aggregate --fleet.source`; every exporter's `/metrics` scraped once a second.",
        "",
        f"- Length {pts[-1].seconds / 60:.0f} min, RSS sampled every {pts[1].seconds - pts[0].seconds:.0f} s;"
        f" warm-up (the longest of the windows {run.windows} filling, and each sidecar's attribution"
        f" memory, bounded at {MAX_TRACKED_BLOCKS:,} blocks and {MAX_FINGERPRINTS:,} fingerprints) the first"
        f" {warm / 60:.0f} min; {filled}.",
        "- Slope: the least-squares fit of RSS over the samples after warm-up, outside the gap.",
    ]
    if run.gap:
        lines.append(
            f"- Marked gap: nats-server stopped from minute {run.gap[0] / 60:.1f} to {run.gap[1] / 60:.1f};"
            f" the sidecars' buffers held at most {max(p.buffered for p in pts):,.0f} messages (bound"
            f" 65,536 each), the aggregator's consumer lag at most {max(p.pending for p in pts):,.0f}."
        )
    lines += [
        f"- Scrapes answered {run.scrapes_ok:,}, failed {run.scrapes_failed}, slowest {run.slowest:.3f} s.",
        f"- Messages published (residency deltas and counters, JetStream acked) {published:,.0f}; read and"
        f" applied by the aggregator {applied:,.0f}; dropped by it {_reasons(agg_dropped)}. The"
        f" difference, {published - applied - sum(agg_dropped.values()):,.0f}, is counters snapshots"
        " superseded by a later one: after a reconnect the aggregator reads each replica's latest.",
        f"- Residency deltas not published by the sidecars (in the gap) {_reasons(pub_dropped)}; deltas"
        f" the aggregator missed (sequence gaps) {missed:,.0f}; lost outside the gap"
        f" {max(missed - in_gap, 0):,.0f}. The sidecars' own missed ZMQ batches {sidecar_missed:,.0f}.",
        "",
        "| process | RSS at start MiB | after warm-up min-max MiB | slope after warm-up MiB/h | CPU ms/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for n in names:
        rss = [p.rss[n] for p in after] or [pts[-1].rss[n]]
        slope = _slope([p.seconds / 3600 for p in after], [p.rss[n] for p in after])
        cpu = pts[-1].cpu[n] / max(pts[-1].seconds, 1e-9) * 1000
        lines.append(
            f"| {n} | {pts[0].rss[n]:.1f} | {min(rss):.1f}-{max(rss):.1f} | {slope:+.2f} | {cpu:.1f} |"
        )
    lines += [
        "",
        "RSS (MiB) over the run, with the sidecars' buffered messages and failed scrapes so far:",
        "",
    ]
    lines += [
        "| minute | " + " | ".join(names) + " | buffered | failed | tracked blocks | tracked fingerprints |",
        "|---:|" + "---:|" * (len(names) + 4),
    ]
    step = max(len(pts) // 24, 1)
    gap = [i for i, p in enumerate(pts) if p.in_gap]
    around = {gap[0] - 1, gap[0], gap[-1], gap[-1] + 1} if gap else set()  # the gap's edges
    rows = sorted({*range(0, len(pts), step), len(pts) - 1, *(i for i in around if 0 <= i < len(pts))})
    for p in (pts[i] for i in rows):
        mark = " (gap)" if p.in_gap else ""
        rss = " | ".join(f"{p.rss[n]:.1f}" for n in names)
        held = f"{p.tracked.get('blocks', 0):,.0f} | {p.tracked.get('fingerprints', 0):,.0f}"
        lines.append(f"| {p.seconds / 60:.1f}{mark} | {rss} | {p.buffered:,.0f} | {p.failed} | {held} |")
    return "\n".join(lines) + "\n"


def _slope(hours: list[float], rss: list[float]) -> float:
    """MiB per hour: a least-squares line, not two end points a sawtooth can tilt."""
    if len(hours) < 2:
        return 0.0
    return statistics.linear_regression(hours, rss).slope


def _reasons(counts: dict[str, float]) -> str:
    total = sum(counts.values())
    if not total:
        return "0"
    return f"{total:,.0f} (" + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(counts.items()) if v) + ")"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=7200, help="soak length (default 2 h)")
    parser.add_argument("--sample-every", type=float, default=30)
    parser.add_argument(
        "--replicas", default="vllm,sglang", help="engine shape per replica: " + ",".join(SHAPES)
    )
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second per replica")
    parser.add_argument(
        "--nats-outage", type=float, default=120.0, help="seconds nats-server is down (0: never)"
    )
    parser.add_argument("--outage-at", type=float, default=0.4, help="when, as a fraction of the run")
    parser.add_argument("--warm-up", type=float, default=3600.0, help="seconds before RSS must be flat")
    parser.add_argument(
        "--windows", default=None, help="--collect.windows for every exporter (default: theirs, up to 1 h)"
    )
    parser.add_argument("--output", default="docs/soak-fleet.md")
    parser.add_argument("--workdir", default=None, help="keep logs here (default: a temporary folder)")
    args = parser.parse_args(argv)
    replicas = args.replicas.split(",")
    if unknown := [r for r in replicas if r not in SHAPES]:
        parser.error(f"unknown replica shape {unknown[0]!r}; known: {', '.join(SHAPES)}")
    with tempfile.TemporaryDirectory(prefix="kvcache-soak-fleet-") as tmp:
        work = Path(args.workdir) if args.workdir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        outage = (args.seconds * args.outage_at, args.nats_outage)
        windows = ("--collect.windows", args.windows) if args.windows else ()
        run = soak(args.seconds, args.sample_every, replicas, outage, args.rate, work, windows)
    text = report(run, args.warm_up)
    Path(args.output).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
