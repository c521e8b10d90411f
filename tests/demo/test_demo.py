"""`kvcache-exporter demo` end to end: a short normalized -> raw -> normalized -> templates schedule,
line mode."""

from __future__ import annotations

import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

PHASE_S = 8
LINE = re.compile(r"^\[\s*(?P<t>[\d.]+)s\] phase=(?P<phase>\w+) \((?P<idx>\d)/4, \+(?P<in>[\d.]+)s\)")
HIT = re.compile(r"hit_ratio\{3s\}=(?P<v>[\d.]+)")
TOP = re.compile(r"top_miss=(?P<cause>\w+)")
OFFSET = re.compile(r"offset=(?P<v>\d+)")
TTFT = re.compile(r"ttft_p99\{3s\}=(?P<v>[\d.]+)s")


def run_demo(*extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "kvcache_exporter.demo", "--phase-seconds", str(PHASE_S), "--speed", "3"]
    argv += ["--refresh", "1", "--window", "3s", "--window", "5m", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def hit_by_phase(stdout: str) -> dict[int, list[tuple[float, float]]]:
    """phase index -> [(seconds into the phase, 3s-window hit ratio)]"""
    out: dict[int, list[tuple[float, float]]] = {1: [], 2: [], 3: [], 4: []}
    for line in stdout.splitlines():
        m, h = LINE.match(line), HIT.search(line)
        if m and h:
            out[int(m["idx"])].append((float(m["in"]), float(h["v"])))
    return out


@pytest.fixture(scope="module")
def demo_run() -> subprocess.CompletedProcess:
    started = time.monotonic()
    result = run_demo("--duration", str(4 * PHASE_S + 4))
    print(f"demo took {time.monotonic() - started:.1f}s\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}")
    return result


def test_demo_exits_cleanly_and_prints_urls(demo_run):
    assert demo_run.returncode == 0, demo_run.stderr
    urls = dict(re.findall(r"^demo: (\w+)\s+(http://127\.0\.0\.1:\d+\S*)", demo_run.stdout, re.M))
    assert urls["exporter"].endswith("/metrics") and "simulator" in urls
    if shutil.which("prometheus"):
        assert "prometheus" in urls, demo_run.stdout
    else:
        assert "not installed" in demo_run.stdout
    assert "demo: stopped, temporary files removed" in demo_run.stdout
    temp = re.search(r"^demo: temp dir (\S+)", demo_run.stdout, re.M)[1]
    assert not Path(temp).exists()


def test_hit_ratio_falls_in_raw_and_recovers(demo_run):
    by_phase = hit_by_phase(demo_run.stdout)
    # Only samples whose 3 s window (plus a 1 s poll) lies entirely inside the phase.
    settled = {i: [v for t, v in samples if t >= 4.5] for i, samples in by_phase.items() if i < 4}
    assert all(settled.values()), by_phase
    assert min(settled[1]) > 0.6, by_phase[1]
    assert max(settled[2]) < 0.1, by_phase[2]
    assert min(settled[3]) > 0.6, by_phase[3]


def settled_lines(stdout: str, phase: int, after: float = 4.5) -> list[str]:
    return [
        line
        for line in stdout.splitlines()
        if (m := LINE.match(line)) and int(m["idx"]) == phase and float(m["in"]) >= after
    ]


def test_the_screen_names_the_cause_of_each_phase(demo_run):
    raw = settled_lines(demo_run.stdout, 2)
    assert raw and all(TOP.search(line)["cause"] == "prefix_diverged" for line in raw), raw
    offsets = [int(OFFSET.search(line)["v"]) for line in raw if OFFSET.search(line)]
    assert offsets and all(8 <= v <= 24 for v in offsets), raw  # the 12-20 token header
    evicted = settled_lines(demo_run.stdout, 4, after=6)  # after the first pass over the templates
    assert evicted and TOP.search(evicted[-1])["cause"] == "evicted", evicted


def test_misses_cost_latency(demo_run):
    """Computed tokens cost what they cost on a GPU: TTFT p99 rises in the raw phase."""
    ttft = {
        phase: sorted(float(TTFT.search(line)["v"]) for line in settled_lines(demo_run.stdout, phase))
        for phase in (1, 2)
    }
    assert ttft[1] and ttft[2], demo_run.stdout[-2000:]
    assert ttft[2][len(ttft[2]) // 2] > 3 * ttft[1][len(ttft[1]) // 2], ttft


def test_sigint_stops_everything():
    argv = [sys.executable, "-m", "kvcache_exporter.demo", "--phase-seconds", "5", "--no-prometheus"]
    argv += ["--refresh", "0.5"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if LINE.match(line):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=20)
    stdout = "".join(lines) + out
    assert proc.returncode == 0, err
    assert "demo: stopped, temporary files removed" in stdout
    ports = re.findall(r"^demo: (simulator|exporter)\s+http://127\.0\.0\.1:(\d+)", stdout, re.M)
    assert len(ports) == 2
    for _, port in ports:  # nothing listens there any more
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", int(port))) != 0
