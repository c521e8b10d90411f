"""`kvcache-exporter demo --fleet`: a pool routed round-robin, then by session, seen by the aggregator."""

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import nats_server

LINE = re.compile(
    r"pool hit ratio \(\w+\)\s+(\d+)% \| with prefix affinity\s+(\d+)% \| other_replica\s+(\d+)%"
)


@pytest.mark.timeout(60)
def test_the_fleet_demo_shows_what_session_routing_wins():
    done = subprocess.run(
        [sys.executable, "-m", "kvcache_exporter", "demo", "--fleet",
         "--phase-seconds", "6", "--duration", "13", "--refresh", "1", "--speed", "5"],
        capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    round_robin, session = done.stdout.split("routing session")
    first = [tuple(map(int, m)) for m in LINE.findall(round_robin)]
    last = [tuple(map(int, m)) for m in LINE.findall(session)]
    assert first and last, done.stdout
    # round-robin: once chats have a few turns, most computed tokens were held by another replica
    assert any(estimate >= real + 10 and other >= 30 for real, estimate, other in first), round_robin
    real, estimate, other = last[-1]
    assert abs(estimate - real) <= 3 and other <= 5, session  # session routing: nothing left to win


NATS_URL = re.compile(r"nats-server \(JetStream\) on nats://127\.0\.0\.1:(\d+), store in (\S+)")
RESIDENT = re.compile(r"resident blocks: (.*)")


def held(line: str) -> dict[str, int]:
    return {name: int(n) for name, n in (part.rsplit(" ", 1) for part in line.split(", "))}


def processes_mentioning(text: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmdline and proc.name != str(os.getpid()):
            found.append(cmdline)
    return found


@pytest.mark.timeout(150)
def test_the_fleet_demo_runs_on_nats_and_leaves_nothing_behind_at_ctrl_c():
    if nats_server.BINARY is None:
        pytest.skip("nats-server is not installed (make system-deps installs it as root)")
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvcache_exporter", "demo", "--fleet", "--fleet.transport", "nats",
         "--phase-seconds", "6", "--refresh", "1", "--speed", "5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lines: list[str] = []
    try:
        for line in demo.stdout:  # until the first phase's residency: the sidecars' deltas went through NATS
            lines.append(line)
            if RESIDENT.match(line):
                break
        demo.send_signal(signal.SIGINT)
        out, err = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
    text = "".join(lines) + out
    assert demo.returncode == 0, err + text
    port, store = NATS_URL.search(text).groups()
    first, last = (held(m) for m in RESIDENT.findall(text)[:2])
    names = {f"replica-{i}" for i in range(4)}
    assert set(first) == names and all(n > 0 for n in first.values()), text  # round-robin: every replica
    assert set(last) == names and all(n > 0 for n in last.values()), text
    rows = [tuple(map(int, m)) for m in LINE.findall(text)]
    assert any(estimate >= real + 10 and other >= 30 for real, estimate, other in rows), text
    # nats-server (its store), the sidecars and the simulator are gone, and so is the temp dir
    assert not Path(store).exists()
    assert processes_mentioning(store) == [] and processes_mentioning(f"127.0.0.1:{port}") == []
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", int(port)), timeout=1).close()


def test_the_fleet_demo_on_nats_says_what_to_install_without_nats_server(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvcache_exporter", "demo", "--fleet", "--fleet.transport", "nats"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": str(tmp_path)},
    )  # fmt: skip
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "apt-get install nats-server" in done.stderr, done.stderr
