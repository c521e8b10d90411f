"""`kvcache-exporter demo --fleet`: a pool routed round-robin, then by session, seen by the aggregator."""

import re
import subprocess
import sys

import pytest

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
